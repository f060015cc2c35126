"""The block layout preprocess hashes with and every inference replica caches with.

Prefix block hashes are only reusable when both sides cut blocks the same way and hash them
with the same definition in the same namespace (llmserve.block_hash: model and tokenizer
fingerprints); a mismatch would make every prefix-cache lookup miss in silence, so the gateway
refuses to start on one (inference refuses hashes of another block size or version from direct
callers too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from llmserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class BlockLayout:
    block_size_tokens: int
    block_hash_version: int
    model_fingerprint: int  # of the checkpoint's config.json
    tokenizer_fingerprint: int  # of its tokenizer.json

    @classmethod
    def of_model_info(cls, model: common_pb2.ModelInfo) -> "BlockLayout":
        """The layout a service reports in its ModelInfo (preprocess and inference alike)."""
        return cls(
            model.block_size_tokens, model.block_hash_version, model.model_fingerprint, model.tokenizer_fingerprint
        )


class BlockLayoutMismatch(ValueError):
    """Preprocess and an inference replica disagree on the block layout (a start-up error)."""


def check_block_layouts(preprocess: BlockLayout, replicas: Mapping[str, BlockLayout]) -> None:
    """Raise BlockLayoutMismatch naming both values and what to fix, for the first replica (by
    address) whose layout differs from preprocess's."""
    for address, replica in replicas.items():
        if replica.block_size_tokens != preprocess.block_size_tokens:
            raise BlockLayoutMismatch(
                f"block size mismatch: preprocess uses {preprocess.block_size_tokens} tokens per block, "
                f"inference at {address} uses {replica.block_size_tokens}; start both with the same "
                "--block-size"
            )
        if replica.block_hash_version != preprocess.block_hash_version:
            raise BlockLayoutMismatch(
                f"block hash version mismatch: preprocess hashes with version {preprocess.block_hash_version}, "
                f"inference at {address} expects version {replica.block_hash_version}; run the same "
                "llmserve release on both (the version is built in, no flag changes it)"
            )
        for part, file_name, fingerprint_of in _NAMESPACE_PARTS:
            if fingerprint_of(replica) != fingerprint_of(preprocess):
                raise BlockLayoutMismatch(
                    f"block hash namespace mismatch: preprocess hashes for a {part} whose {file_name} has "
                    f"fingerprint {fingerprint_of(preprocess):016x}, inference at {address} serves one with "
                    f"{fingerprint_of(replica):016x}; start both with the same --model (the same checkpoint, "
                    "byte for byte)"
                )


# (what, the checkpoint file it is named by, its fingerprint in a layout)
_NAMESPACE_PARTS = (
    ("model", "config.json", lambda layout: layout.model_fingerprint),
    ("tokenizer", "tokenizer.json", lambda layout: layout.tokenizer_fingerprint),
)

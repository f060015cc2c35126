"""The block layout preprocess hashes with and every inference replica caches with.

Prefix block hashes are only reusable when both sides cut blocks the same way and hash them
with the same definition; a mismatch would make every prefix-cache lookup miss in silence, so
the gateway refuses to start on one (inference refuses such hashes from direct callers too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True, slots=True)
class BlockLayout:
    block_size_tokens: int
    block_hash_version: int


class BlockLayoutMismatch(ValueError):
    """Preprocess and an inference replica disagree on the block layout (a start-up error)."""


def check_block_layouts(preprocess: BlockLayout, replicas: Mapping[str, BlockLayout]) -> None:
    """Raise BlockLayoutMismatch naming both values and the flag to fix, for the first replica
    (by address) whose layout differs from preprocess's."""
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

"""TensorRT-LLM's KV cache events, in llmserve's hashes (for the `trtllm` backend).

UNTESTED against TensorRT-LLM itself (it cannot be installed here; see trtllm_engine.py): this
reads the dicts `LLM.get_kv_cache_events_async` yields, as its KVCacheEventSerializer writes
them: {"event_id", "window_size", "data": {"type": ...}} with data
  stored    {"parent_hash": int | None, "blocks": [{"block_hash", "tokens": [{"token_id",
            "token_extra_id"}], "cache_level", "priority"}]}
  removed   {"block_hashes": [int]}
  created / updated: pool sizes, cache level and priority changes: nothing routing needs.

Why translate: the routing index is keyed by llmserve.block_hash's chained hashes, the ones
preprocess computes for every request; TensorRT-LLM hashes blocks its own way. So each stored
block's tokens are hashed again with our chain, parent first, and TensorRT-LLM's hash is mapped
to ours so that its removal can be told. A block that cannot be chained is skipped with what
follows it in that event: a partial block, a block whose tokens carry extra ids (LoRA or
multimodal content our hash does not see), or one whose parent was stored before this
translator started. TensorRT-LLM's reuse knows no cache salt, so blocks are hashed in the
unsalted namespace: requests sent with a salt match nothing and are routed by load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from llmserve.block_hash import HashNamespace, hash_block
from llmserve.inference.engine.types import CacheEvent


class TrtllmKvEventTranslator:
    def __init__(self, namespace: HashNamespace):
        self._seed = namespace.seed()
        self._block_size = namespace.block_size_tokens
        # TensorRT-LLM's hash → ours, for every block stored and not yet removed.
        self._ours: dict[int, int] = {}

    def translate(self, events: Iterable[dict]) -> list[CacheEvent]:
        translated: list[CacheEvent] = []
        for event in events:
            data = event.get("data") or {}
            kind = data.get("type")
            if kind == "stored":
                translated.extend(self._stored(data))
            elif kind == "removed":
                translated.extend(self._removed(data))
        return translated

    def _stored(self, data: dict) -> Iterator[CacheEvent]:
        trt_parent = data.get("parent_hash")
        if trt_parent is None:
            parent, chain = None, self._seed
        elif trt_parent in self._ours:
            parent = chain = self._ours[trt_parent]
        else:
            return
        hashes: list[int] = []
        for block in data.get("blocks", ()):
            tokens = block.get("tokens", ())
            if len(tokens) != self._block_size or any(token.get("token_extra_id") for token in tokens):
                break
            chain = hash_block(chain, [token["token_id"] for token in tokens])
            self._ours[block["block_hash"]] = chain
            hashes.append(chain)
        if hashes:
            yield (parent, hashes)

    def _removed(self, data: dict) -> Iterator[CacheEvent]:
        for trt_hash in data.get("block_hashes", ()):
            ours = self._ours.pop(trt_hash, None)
            if ours is not None:
                yield ours

"""The one definition of prefix block hashes, shared by preprocess, the engine and routing.

A prompt is cut into full blocks of `block_size` tokens (a trailing partial block gets no
hash). Block i's hash covers every token before its end, by chaining:

    h_0 = H(SEED_v || tokens[0:B])
    h_i = H(h_{i-1} || tokens[i*B:(i+1)*B])

with H = BLAKE2b-64 over little-endian uint64 parent hash and uint32 token ids. Equal hashes
therefore mean equal prefixes (up to collision), which is what KV-cache reuse needs. The engine
still compares the tokens of a cached block before reusing it, so a collision cannot change an
output. Any change to this definition bumps HASH_VERSION; consumers ignore hashes of a version
they do not know.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

HASH_VERSION = 1
DEFAULT_BLOCK_SIZE = 16
# Parent "hash" of the first block: a constant tied to the version, so v1 hashes never collide
# with a future version's by construction.
_SEED = int.from_bytes(hashlib.blake2b(b"llmserve-block-hash-v1", digest_size=8).digest(), "little")


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", _SEED if parent_hash is None else parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little")


def chain_block_hashes(
    token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, parent_hash: int | None = None
) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes

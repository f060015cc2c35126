"""The one definition of prefix block hashes, shared by preprocess, the engine and routing.

A prompt is cut into full blocks of `block_size` tokens (a trailing partial block gets no
hash). Block i's hash covers every token before its end, and the namespace, by chaining:

    seed = H(HASH_VERSION, model fingerprint, tokenizer fingerprint, block size, cache salt)
    h_0  = H(seed || tokens[0:B])
    h_i  = H(h_{i-1} || tokens[i*B:(i+1)*B])

with H = BLAKE2b-64 over little-endian uint64 parent hash and uint32 token ids. Equal hashes
therefore mean equal prefixes (up to collision) in one namespace, which is what KV-cache reuse
needs; two namespaces share no hash. The engine still compares the tokens of a cached block
before reusing it, so a collision cannot change an output. Any change to this definition
bumps HASH_VERSION; consumers ignore hashes of a version they do not know.

The namespace (HashNamespace): the model and tokenizer a replica serves, named by the bytes of
the checkpoint's config.json and tokenizer.json, which every service that is handed the model
directory reads (preprocess and inference load both, so they agree on one directory); and
the block size. The cache salt is per request: tenants whose requests carry different salts
share no cache entry and cannot probe each other's prompts through cache hits or timing,
while requests with equal salts (or none, "") share.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from llmserve import token_id_bytes
from llmserve.client_text import num_bytes
from llmserve.errors import InvalidArgument

HASH_VERSION = 2
DEFAULT_BLOCK_SIZE = 16
# The checkpoint files whose bytes name the model and the tokenizer in the namespace. The
# weights are left out: reading gigabytes at start-up is not cheap, and preprocess has no use
# for them. A checkpoint whose weights change under the same config.json (a fine-tune saved in
# place) keeps its namespace, which costs nothing: a restarted replica starts with an empty
# cache, and its new incarnation drops its old entries from the routing index.
MODEL_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
_SEED_DOMAIN = b"llmserve-block-hash"


def fingerprint(data: bytes) -> int:
    """BLAKE2b-64 of `data`: how a file's bytes enter the namespace."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class HashNamespace:
    """What a block's hash is namespaced by besides its request's salt (module docstring)."""

    model_fingerprint: int
    tokenizer_fingerprint: int
    block_size_tokens: int

    @classmethod
    def of_model_dir(cls, model_dir: str | Path, block_size_tokens: int) -> "HashNamespace":
        """The namespace of the checkpoint in `model_dir` cut into blocks of `block_size_tokens`."""
        model_dir = Path(model_dir)
        return cls(
            model_fingerprint=fingerprint((model_dir / MODEL_FILE).read_bytes()),
            tokenizer_fingerprint=fingerprint((model_dir / TOKENIZER_FILE).read_bytes()),
            block_size_tokens=block_size_tokens,
        )

    def seed(self, cache_salt: str = "") -> int:
        """Parent hash of the first block of a prompt sent with `cache_salt` ("" = no salt)."""
        h = hashlib.blake2b(_SEED_DOMAIN, digest_size=8)
        parts = (HASH_VERSION, self.model_fingerprint, self.tokenizer_fingerprint, self.block_size_tokens)
        h.update(struct.pack("<IQQI", *parts))
        h.update(cache_salt.encode("utf-8"))  # last, so its length needs no prefix
        return int.from_bytes(h.digest(), "little")

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str = "") -> list[int]:
        """Hashes of every full block of the prompt `token_ids` sent with `cache_salt`."""
        return chain_block_hashes(token_ids, self.block_size_tokens, self.seed(cache_salt))


# A salt names a tenant (a secret or its hash); hashing more than a few hundred bytes buys
# nothing, and every hop carries the salt with the request.
MAX_CACHE_SALT_BYTES = 256


def check_cache_salt(cache_salt: str) -> None:
    """Refuse a salt over MAX_CACHE_SALT_BYTES; its value is never quoted (it may be a secret)."""
    if num_bytes(cache_salt) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument(
            "cache_salt", f"{num_bytes(cache_salt)} bytes exceeds the limit of {MAX_CACHE_SALT_BYTES} bytes"
        )


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (a namespace seed for the first block)."""
    return _hash_packed_block(parent_hash, token_id_bytes.pack(token_ids))


def chain_block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`.

    The prompt's full blocks are packed once and hashed slice by slice: ~26% less than packing
    each block on its own (504 blocks of an 8k-token prompt: 486-490 → 359-361 µs in 3 runs on
    the 2-core development machine; docs/benchmarks.md, "Nineteenth session"), on preprocess's
    path for every request."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_tokens = len(token_ids) // block_size * block_size
    packed = memoryview(token_id_bytes.pack(token_ids[:num_full_tokens]))
    block_bytes = block_size * token_id_bytes.BYTES_PER_ID
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(packed), block_bytes):
        parent = _hash_packed_block(parent, packed[start : start + block_bytes])
        hashes.append(parent)
    return hashes


def _hash_packed_block(parent_hash: int, packed_token_ids: bytes | memoryview) -> int:
    """H(little-endian uint64 parent || the block's ids as token_id_bytes packs them)."""
    digest = hashlib.blake2b(parent_hash.to_bytes(8, "little") + packed_token_ids, digest_size=8).digest()
    return int.from_bytes(digest, "little")

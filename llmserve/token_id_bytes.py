"""Token ids as bytes: little-endian uint32s, 4 bytes each.

How a prompt's ids cross preprocess → gateway → inference (the `token_id_bytes` fields of the
protos) and how the Redis prompt store keeps them. Why not protobuf's repeated uint32: every
process that touches those turns varints into Python ints and back, ~60 ns per id for the
gateway's relay alone (1.9 ms on its event loop for a 32k-token prompt); bytes pass through the
gateway untouched, and are packed and unpacked here at C speed (bench/bench_prompt_ids.py).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

import numpy as np

from llmserve.errors import InvalidArgument

BYTES_PER_ID = 4
_ARRAY_TYPECODE = "I"  # unsigned int: 4 bytes on every platform CPython and numpy build for
_LITTLE_ENDIAN_IDS = np.dtype("<u4")
assert array.array(_ARRAY_TYPECODE).itemsize == BYTES_PER_ID


def pack(token_ids: Sequence[int]) -> bytes:
    """The ids as bytes. Each must fit a uint32 (OverflowError otherwise: a bug, not input)."""
    ids = array.array(_ARRAY_TYPECODE, token_ids)  # faster than numpy from a list (~6 ns per id)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


def count(data: bytes) -> int:
    """How many ids `data` holds (a whole number when check_length passed)."""
    return len(data) // BYTES_PER_ID


def check_length(data: bytes, field: str) -> None:
    """INVALID_ARGUMENT naming `field` unless `data` is whole ids."""
    if len(data) % BYTES_PER_ID:
        raise InvalidArgument(
            field, f"{len(data)} bytes is not a whole number of token ids ({BYTES_PER_ID} bytes each, little-endian)"
        )


def as_array(data: bytes) -> np.ndarray:
    """A read-only view of the ids, for checks at C speed (no copy)."""
    return np.frombuffer(data, dtype=_LITTLE_ENDIAN_IDS)


def unpack(data: bytes) -> list[int]:
    """The ids as a list (check_length first)."""
    return as_array(data).tolist()


def last(data: bytes, num_ids: int) -> list[int]:
    """The last `num_ids` ids (all when fewer), without unpacking the rest."""
    start = max(0, count(data) - num_ids) * BYTES_PER_ID
    return as_array(data[start:]).tolist()

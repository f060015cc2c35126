"""Token ids as little-endian uint32 bytes (llmserve.token_id_bytes)."""

from __future__ import annotations

import struct

import pytest

from llmserve import token_id_bytes
from llmserve.errors import InvalidArgument

IDS = [0, 1, 255, 256, 151_935, 2**32 - 1]


def test_ids_pack_to_little_endian_uint32s_and_back():
    data = token_id_bytes.pack(IDS)
    assert data == struct.pack(f"<{len(IDS)}I", *IDS)
    assert token_id_bytes.unpack(data) == IDS
    assert token_id_bytes.count(data) == len(IDS)
    assert token_id_bytes.pack([]) == b"" and token_id_bytes.unpack(b"") == []


def test_the_last_ids_are_read_without_the_rest():
    data = token_id_bytes.pack(IDS)
    assert token_id_bytes.last(data, 2) == IDS[-2:]
    assert token_id_bytes.last(data, 0) == []
    assert token_id_bytes.last(data, 100) == IDS
    assert token_id_bytes.last(b"", 5) == []


def test_a_length_that_is_not_whole_ids_is_refused_naming_the_field():
    token_id_bytes.check_length(token_id_bytes.pack(IDS), "f")
    with pytest.raises(InvalidArgument) as error:
        token_id_bytes.check_length(b"\x01\x02\x03\x04\x05", "prompt_token_id_bytes")
    assert (error.value.field, error.value.problem) == (
        "prompt_token_id_bytes", "5 bytes is not a whole number of token ids (4 bytes each, little-endian)",
    )


def test_an_id_past_uint32_is_a_bug_not_input():
    with pytest.raises(OverflowError):
        token_id_bytes.pack([2**32])
    with pytest.raises(OverflowError):
        token_id_bytes.pack([-1])

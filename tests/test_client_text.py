"""Client values quoted short and long texts cut (llmserve.client_text), and the last guard on
what a status sends (llmserve.errors): exact outputs, whatever the value holds."""

from __future__ import annotations

import pytest

from llmserve.client_text import num_bytes, quoted, shortened
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from llmserve.errors import (
    MAX_RICH_STATUS_BYTES,
    MAX_STATUS_MESSAGE_BYTES,
    InvalidArgument,
    NotFound,
    _within_metadata_limit,
    rich_status_for,
)

# Values a client can send in a string field (and our own text may hold: lone surrogates).
HOSTILE_VALUES = [
    "r" * 100_000,
    "\n" * 10_000,
    "\x00\x1b[31m" * 5_000,
    "é" * 50_000,
    "\U0010ffff" * 30_000,
    "\ud800" * 10_000,
    "'\"\\" * 10_000,
    b"\xff" * 50_000,
]


@pytest.mark.parametrize("value", ["user", "", "système", "it's", b"raw"])
def test_a_short_value_is_quoted_as_repr_quotes_it(value):
    assert quoted(value) == repr(value)


def test_a_long_value_is_a_prefix_then_its_length_in_bytes():
    assert quoted("r" * 7000) == "'" + "r" * 38 + "…' (7000 bytes)"
    assert quoted(b"x" * 9000) == "b'" + "x" * 37 + "…' (9000 bytes)"
    assert quoted("é" * 100).endswith("…' (200 bytes)")  # UTF-8 bytes, not characters


@pytest.mark.parametrize("value", HOSTILE_VALUES, ids=lambda v: repr(v[:3]))
def test_a_quote_is_short_whatever_the_value_holds(value):
    quote = quoted(value)
    assert len(quote) <= 80
    assert "\n" not in quote and "\x00" not in quote
    assert quote.endswith(f" ({num_bytes(value)} bytes)")
    quote.encode("utf-8")  # a lone surrogate is escaped, never written: the quote always encodes


def test_num_bytes_counts_utf8():
    assert [num_bytes(v) for v in ("abc", "é", "\U0010ffff", "\ud800", b"ab")] == [3, 2, 4, 3, 2]


def test_shortened_keeps_head_and_tail_within_the_budget_and_says_how_much_was_cut():
    text = "head" + "x" * 10_000 + "tail"
    cut = shortened(text, 1000)
    assert num_bytes(cut) <= 1000
    assert cut.startswith("headxxx") and cut.endswith("xxxtail")
    num_kept = len(cut.replace(" …[", "|").split("|")[0]) + len(cut.split("]… ")[1])
    assert f" …[{len(text) - num_kept} bytes cut]… " in cut
    assert shortened("short", 1000) == "short"


@pytest.mark.parametrize("value", [v for v in HOSTILE_VALUES if isinstance(v, str)], ids=lambda v: repr(v[:3]))
def test_shortened_stays_within_the_budget_for_any_text(value):
    assert num_bytes(shortened(value, 512)) <= 512


def test_a_status_message_and_its_violation_are_capped_whatever_the_error_says():
    error = InvalidArgument("chat.messages[0].role" + "]" * 10_000, "unknown role " + "r" * 100_000)
    status = rich_status_for(error)
    assert num_bytes(status.message) <= MAX_STATUS_MESSAGE_BYTES
    assert status.ByteSize() <= MAX_RICH_STATUS_BYTES
    assert status.message.startswith("chat.messages[0].role]]]") and "bytes cut]" in status.message


def test_a_status_of_a_short_message_is_sent_as_it_is():
    status = rich_status_for(NotFound("model: unknown model 'x'"))
    assert status.message == "model: unknown model 'x'" and not status.details


def _packed(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def test_details_past_the_rich_status_limit_are_left_out_in_order():
    retry = _packed(error_details_pb2.RetryInfo())
    huge = _packed(error_details_pb2.ErrorInfo(reason="r", metadata={"estimate": "9" * 10_000}))
    status = status_pb2.Status(code=8, message="full", details=[retry, huge, retry])
    bounded = _within_metadata_limit(status)
    assert bounded.ByteSize() <= MAX_RICH_STATUS_BYTES
    assert (bounded.code, bounded.message, list(bounded.details)) == (8, "full", [retry, retry])
    small = status_pb2.Status(code=8, message="ok", details=[retry])
    assert _within_metadata_limit(small) is small

"""What a log line may cost: capped in length by both formatters (llmserve.log_format) and
rate-limited per kind (llmserve.log_rate_limit), on a logger of its own and a fake clock."""

from __future__ import annotations

import io
import json
import logging

import pytest

from llmserve.client_text import num_bytes
from llmserve.log_format import MAX_LINE_BYTES, JsonFormatter, TextFormatter
from llmserve.log_rate_limit import MAX_KINDS, LogRateLimit, RateLimit

WINDOW_S = 10.0


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _logger(formatter: logging.Formatter, *filters: logging.Filter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    for log_filter in filters:
        handler.addFilter(log_filter)
    logger = logging.getLogger(f"tests.log_limits.{id(out)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.handlers = [handler]
    return logger, out


# --- the line cap -------------------------------------------------------------------------------

LONG_VALUES = ["r" * 100_000, "\x00" * 50_000, "é" * 50_000, "\U0001f600" * 30_000]


@pytest.mark.parametrize("log_prompts", [False, True])
@pytest.mark.parametrize("value", LONG_VALUES, ids=["ascii", "controls", "latin", "emoji"])
def test_a_json_line_is_one_object_within_the_cap_and_keeps_its_fixed_keys(value, log_prompts):
    logger, out = _logger(JsonFormatter("preprocess", log_prompts=log_prompts))
    logger.info("rejected: %s", value, extra={"prompt": value, "prompt_token_ids": list(range(5000)), "bucket": 2})
    (text,) = out.getvalue().splitlines()
    assert len(text.encode()) <= MAX_LINE_BYTES
    line = json.loads(text)
    assert (line["service"], line["level"], line["bucket"]) == ("preprocess", "INFO", 2)
    assert line["message"].startswith("rejected: ") and "bytes cut]" in line["message"]


@pytest.mark.parametrize("value", LONG_VALUES, ids=["ascii", "controls", "latin", "emoji"])
def test_a_text_line_with_its_traceback_is_cut_within_the_cap_keeping_the_last_line(value):
    logger, out = _logger(TextFormatter("gateway", log_prompts=True))
    try:
        raise ValueError("the end")
    except ValueError:
        logger.exception("failed on %s", value)
    text = out.getvalue().rstrip("\n")
    assert num_bytes(text) <= MAX_LINE_BYTES
    assert " ERROR gateway " in text and "bytes cut]" in text and text.endswith("ValueError: the end")


def test_a_line_under_the_cap_is_written_as_it_is():
    logger, out = _logger(JsonFormatter("inference", log_prompts=False))
    logger.info("admitted: %d prompt tokens", 42)
    assert json.loads(out.getvalue())["message"] == "admitted: 42 prompt tokens"


# --- the rate limit -----------------------------------------------------------------------------


def test_each_kind_gets_its_lines_per_window_then_the_next_line_counts_the_rest():
    clock = FakeClock()
    logger, out = _logger(JsonFormatter("preprocess", log_prompts=False), LogRateLimit(3, WINDOW_S, clock=clock))
    for i in range(10):
        logger.info("rejected: %s", f"role {i}")  # one kind, whatever the arguments
    logger.info("another kind")
    clock.now_s += WINDOW_S
    logger.info("rejected: %s", "role 10")
    lines = [json.loads(text) for text in out.getvalue().splitlines()]
    assert [line["message"] for line in lines] == [
        "rejected: role 0", "rejected: role 1", "rejected: role 2", "another kind", "rejected: role 10",
    ]
    assert [line.get("num_suppressed_lines") for line in lines] == [None, None, None, None, 7]


def test_kinds_are_told_apart_by_logger_and_template_and_debug_is_never_limited():
    clock = FakeClock()
    rate_limit = LogRateLimit(1, WINDOW_S, clock=clock)
    first, first_out = _logger(TextFormatter("gateway", log_prompts=False), rate_limit)
    second, second_out = _logger(TextFormatter("gateway", log_prompts=False), rate_limit)
    for logger in (first, second):
        logger.warning("aborted: %s", "a")
        logger.warning("aborted: %s", "b")
        logger.warning("refused: %s", "c")
    for i in range(5):
        first.debug("admitted %d", i)
    assert [line.split(": ", 1)[1] for line in first_out.getvalue().splitlines()] == [
        "aborted: a", "refused: c", *(f"admitted {i}" for i in range(5)),
    ]
    assert [line.split(": ", 1)[1] for line in second_out.getvalue().splitlines()] == ["aborted: a", "refused: c"]


def test_a_window_starts_at_its_first_line_and_refused_counts_carry_over():
    clock = FakeClock()
    limit = RateLimit(2, WINDOW_S, clock=clock)
    assert [limit.admit("k") for _ in range(4)] == [0, 0, None, None]
    clock.now_s += WINDOW_S - 0.001
    assert limit.admit("k") is None
    clock.now_s += 0.001
    assert [limit.admit("k"), limit.admit("k"), limit.admit("k")] == [3, 0, None]


def test_the_table_of_kinds_is_bounded():
    clock = FakeClock()
    limit = RateLimit(1, WINDOW_S, clock=clock)
    for i in range(MAX_KINDS):
        limit.admit(i)
    clock.now_s += WINDOW_S
    for i in range(MAX_KINDS, 3 * MAX_KINDS):  # f-string messages: a new kind per line
        assert limit.admit(i) == 0
    assert len(limit._windows) <= MAX_KINDS

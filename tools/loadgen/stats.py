"""From request records to the numbers a benchmark reports.

Definitions (every latency in milliseconds; successful requests only):
  TTFT   time to first token: request sent → first message carrying a token.
  ITL    inter-token latency: the gap between two messages spread evenly over the tokens the
         later one carries (a message with 3 tokens after 30 ms gives three 10 ms samples), so a
         server that coalesces tokens is measured per token, as a reader sees them arrive.
  TPOT   time per output token after the first: (E2E - TTFT) / (completion tokens - 1), per request.
  E2E    request sent → last message.
  QUEUE  the serving engine's own report of the wait before the request's first step (the
         final message's Timings), for the requests whose server sent one: where TTFT goes
         besides the hops and the prefill.
Throughput is over the whole run (first send → last end): output tok/s counts completion
tokens, total tok/s adds prompt tokens, request rate counts successful requests; messages counts
the stream messages the successful requests received (how much the server coalesced).
"""

from __future__ import annotations

import collections
import math

from llmserve.tools.loadgen.client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def distribution(values: list[float]) -> dict:
    ordered = sorted(values)
    summary = {f"p{p}": percentile(ordered, p) for p in PERCENTILES}
    summary["mean"] = sum(ordered) / len(ordered) if ordered else math.nan
    summary["max"] = ordered[-1] if ordered else math.nan
    summary["count"] = len(ordered)
    return summary


def ttft_ms(record: RequestRecord) -> float | None:
    first = record.first_token_s
    return None if first is None else (first - record.start_s) * 1e3


def itl_samples_ms(record: RequestRecord) -> list[float]:
    samples = []
    for previous, now, num_tokens in zip(record.message_times_s, record.message_times_s[1:], record.message_num_tokens[1:]):
        samples += [(now - previous) * 1e3 / num_tokens] * num_tokens
    return samples


def tpot_ms(record: RequestRecord) -> float | None:
    first = record.first_token_s
    if first is None or record.num_completion_tokens < 2:
        return None
    return (record.end_s - first) * 1e3 / (record.num_completion_tokens - 1)


def latency_samples_ms(records: list[RequestRecord]) -> dict[str, list[float]]:
    """TTFT, ITL, TPOT and E2E samples of the successful requests."""
    ok = [r for r in records if r.is_ok]
    return {
        "ttft_ms": [v for r in ok if (v := ttft_ms(r)) is not None],
        "itl_ms": [v for r in ok for v in itl_samples_ms(r)],
        "tpot_ms": [v for r in ok if (v := tpot_ms(r)) is not None],
        "e2e_ms": [(r.end_s - r.start_s) * 1e3 for r in ok],
        "queue_ms": [r.queue_ms for r in ok if r.queue_ms is not None],
    }


def summarize(records: list[RequestRecord], start_s: float, end_s: float) -> dict:
    ok = [r for r in records if r.is_ok]
    duration_s = max(end_s - start_s, 1e-9)
    num_completion = sum(r.num_completion_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_succeeded": len(ok),
        "errors_by_status": dict(collections.Counter(r.status for r in records if not r.is_ok)),
        "duration_s": duration_s,
        "request_rate_per_s": len(ok) / duration_s,
        "output_tokens_per_s": num_completion / duration_s,
        "total_tokens_per_s": (num_prompt + num_completion) / duration_s,
        "num_prompt_tokens": num_prompt,
        "num_completion_tokens": num_completion,
        "num_cached_tokens": sum(r.num_cached_tokens for r in ok),
        "num_pulled_tokens": sum(r.num_pulled_tokens for r in ok),
        "num_messages": sum(len(r.message_times_s) for r in ok),
        # the gateway workers' shares of the load (gRPC to a gateway; empty elsewhere)
        "completion_tokens_by_worker": tokens_by_worker(ok),
        **{name: distribution(values) for name, values in latency_samples_ms(records).items()},
        "first_errors": [f"{r.status}: {r.error}" for r in records if not r.is_ok][:5],
    }


def tokens_by_worker(records: list[RequestRecord]) -> dict[str, int]:
    """Completion tokens per gateway worker that served them, by worker id."""
    tokens: dict[str, int] = {}
    for record in records:
        if record.worker:
            tokens[record.worker] = tokens.get(record.worker, 0) + record.num_completion_tokens
    return dict(sorted(tokens.items()))


def timeline(records: list[RequestRecord], start_s: float, end_s: float, bin_s: float = 1.0) -> dict:
    """Per time bin since the start: output tokens/s arrived and requests in flight at its middle."""
    num_bins = max(1, math.ceil((end_s - start_s) / bin_s))
    tokens = [0] * num_bins
    for record in records:
        for time_s, num_tokens in zip(record.message_times_s, record.message_num_tokens):
            tokens[min(num_bins - 1, int((time_s - start_s) / bin_s))] += num_tokens
    in_flight = []
    for b in range(num_bins):
        middle = start_s + (b + 0.5) * bin_s
        in_flight.append(sum(1 for r in records if r.start_s <= middle < r.end_s))
    return {
        "bin_s": bin_s,
        "time_s": [(b + 0.5) * bin_s for b in range(num_bins)],
        "output_tokens_per_s": [n / bin_s for n in tokens],
        "requests_in_flight": in_flight,
    }

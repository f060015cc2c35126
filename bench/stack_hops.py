"""Where a request's first token goes, hop by hop, from the gateway's own histograms (issue 19:
at 256 streams the stack's TTFT p50 was 338-1,122 ms against the core loop's 149-219 ms).

Per cell, the gateway's /metrics scraped before and after it, each histogram's mean over the
cell's requests (its _sum / _count deltas):
  preprocess      the preprocess hop (llmserve_gateway_request_preprocess_time_seconds);
  queue           in the replica before its first step (..._request_queue_time_seconds);
  first_token     accepted by the gateway to its first token from inference
                  (..._time_to_first_token_seconds): preprocess, routing, the replica's queue,
                  the prefill step, and the hop back;
and, from the client's records, its own mean TTFT: the first token's time at the client. The
client's mean less the gateway's first_token is what the client-to-gateway hops and the
gateway's write of the token cost.
"""

from __future__ import annotations

import statistics

from metrics_scrape import sample_totals
from llmserve.tools.loadgen.client import RequestRecord

HOP_HISTOGRAMS = {
    "preprocess": "llmserve_gateway_request_preprocess_time_seconds",
    "queue": "llmserve_gateway_request_queue_time_seconds",
    "first_token": "llmserve_gateway_time_to_first_token_seconds",
}


def scrape_hops(metrics_port: int) -> dict[str, tuple[float, float]]:
    """Each hop histogram's (sum, count), summed over the gateway's workers."""
    totals = sample_totals(metrics_port)
    return {hop: (totals.get(name + "_sum", 0.0), totals.get(name + "_count", 0.0))
            for hop, name in HOP_HISTOGRAMS.items()}


def hop_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                 records: list[RequestRecord]) -> dict[str, float | None]:
    """Each hop's mean ms over the cell (None where the cell observed none), and the client's."""
    means: dict[str, float | None] = {}
    for hop in HOP_HISTOGRAMS:
        num = after[hop][1] - before[hop][1]
        means[hop] = round((after[hop][0] - before[hop][0]) / num * 1000, 2) if num > 0 else None
    first_tokens = [r.message_times_s[0] - r.start_s for r in records if r.status == "OK" and r.message_times_s]
    means["client"] = round(statistics.fmean(first_tokens) * 1000, 2) if first_tokens else None
    return means

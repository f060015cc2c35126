"""The inference replica's Prometheus metrics (`llmserve_inference_*`, docs/observability.md).

All of them live in the server process, on the default registry that --metrics-port serves:
  - the load (running, waiting, KV blocks) and the engine's own counters (prefix cache,
    preemptions) are read from `engine.load()` when scraped (LoadCollector), so the engine
    pays nothing for them;
  - step duration and batch size come from the StepReports that cross from the engine core
    with each step's outputs, prompt and generation tokens from the outputs AsyncEngine routes,
    refusals from admission: a few observations per step at most, never one per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmserve.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, ServiceError
from llmserve.inference.engine.types import EngineLoad, StepReport

# From a GPU decode step of a small model (~1 ms) to a long CPU prefill.
STEP_DURATION_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

_STEP_DURATION = Histogram(
    "llmserve_inference_step_duration_seconds",
    "One engine step that ran a batch (async scheduling: launching it and processing the one before)",
    buckets=STEP_DURATION_BUCKETS_S,
)
_BATCH_SIZE = Histogram(
    "llmserve_inference_batch_size", "Sequences in the batch of one engine step", buckets=BATCH_SIZE_BUCKETS
)
_PROMPT_TOKENS = Counter(
    "llmserve_inference_prompt_tokens", "Prompt tokens of requests that produced their first token (prefilled or cached)"
)
_GENERATION_TOKENS = Counter("llmserve_inference_generation_tokens", "Tokens sampled and streamed")
_ADMISSIONS_REFUSED = Counter(
    "llmserve_inference_admissions_refused", "Requests refused at admission, by status code", ["reason"]
)
# How prompts arrive (GenerateTokensRequest): as token_id_bytes, which the gateway sends a
# replica that takes them; in preprocess's shared-memory ring ("region": long prompts, replica
# on preprocess's host); or as token_ids (direct callers, a gateway before the field). A gateway
# that should send bytes and does not shows here.
_PROMPTS_RECEIVED = Counter(
    "llmserve_inference_prompts_received", "Prompts received, by how their token ids were encoded", ["encoding"]
)
PROMPTS_AS_TOKEN_ID_BYTES = _PROMPTS_RECEIVED.labels(encoding="token_id_bytes")
PROMPTS_AS_TOKEN_IDS = _PROMPTS_RECEIVED.labels(encoding="token_ids")
PROMPTS_IN_REGION = _PROMPTS_RECEIVED.labels(encoding="region")
_REFUSED_BY_CODE = {
    error.code: _ADMISSIONS_REFUSED.labels(reason=error.code.name)
    for error in (ResourceExhausted, DeadlineExceeded, InvalidArgument)
}


def record_steps(steps: list[StepReport]) -> None:
    for step in steps:
        _STEP_DURATION.observe(step.duration_s)
        _BATCH_SIZE.observe(step.num_seqs)


def record_tokens(num_prompt_tokens: int, num_generation_tokens: int) -> None:
    if num_prompt_tokens:
        _PROMPT_TOKENS.inc(num_prompt_tokens)
    if num_generation_tokens:
        _GENERATION_TOKENS.inc(num_generation_tokens)


def record_refused(refusal: ServiceError) -> None:
    _REFUSED_BY_CODE[refusal.code].inc()


class LoadCollector(Collector):
    """The engine's load snapshot as gauges and its running totals as counters, read at scrape
    time (on the metrics endpoint's thread: `load` must be a cheap read of a snapshot)."""

    def __init__(self, load: Callable[[], EngineLoad]):
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        yield _gauge("requests_running", "Sequences in the running batch", load.num_running)
        yield _gauge("requests_waiting", "Sequences admitted and not yet scheduled", load.num_waiting)
        yield _gauge("kv_blocks_used", "KV blocks held by sequences", load.kv_blocks_used)
        yield _gauge("kv_blocks_total", "KV blocks in the pool (0: no paged pool)", load.kv_blocks_total)
        yield _counter(
            "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
            load.prefix_cache_queried_tokens_total,
        )  # fmt: skip
        yield _counter(
            "prefix_cache_hit_tokens", "Looked-up prompt tokens found in the prefix cache",
            load.prefix_cache_hit_tokens_total,
        )  # fmt: skip
        yield _counter("preemptions", "Sequences preempted for KV space", load.num_preemptions_total)


def register_load(load: Callable[[], EngineLoad]) -> None:
    """Export the load `load()` returns (an engine's `load`) with the other inference metrics."""
    REGISTRY.register(LoadCollector(load))


def _gauge(name: str, documentation: str, value: int) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"llmserve_inference_{name}", documentation, value=value)


def _counter(name: str, documentation: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(f"llmserve_inference_{name}", documentation, value=value)

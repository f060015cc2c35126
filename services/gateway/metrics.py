"""The gateway's Prometheus metrics (names in docs/observability.md): requests and routing.

The metric objects live here, in the default registry; the pipeline, servicer and router call
the `record_*` functions and `tracked_request`. Labelled children are bound once, at import
(finish reasons, status codes) or per request (a replica's label), never per token.

With `--workers N` each worker writes its values to files in PROMETHEUS_MULTIPROC_DIR (set by
the parent before it spawns them: prometheus-client picks its storage when it is imported) and
the parent sums them (llmserve.metrics_endpoint); the gauges say how: in-flight streams add up
over workers, live replicas are what the worker seeing the most sees.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import grpc
from prometheus_client import Counter, Gauge, Histogram

from llmserve.batched_histogram import BatchedHistogram
from llmserve.errors import ServiceError
from llmserve.sampling import FinishReason

if TYPE_CHECKING:
    from llmserve.gateway.generation import GenerationResult

_PREFIX = "llmserve_gateway_"
_NS_PER_S = 1e9

# Seconds, from a cached prompt on a fast replica to a long prompt behind a queue.
_LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)
# Seconds between tokens: one engine step (milliseconds) up to a stall.
_TOKEN_GAP_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)

TIME_TO_FIRST_TOKEN = Histogram(
    _PREFIX + "time_to_first_token_seconds", "Request accepted to its first token from inference.",
    buckets=_LATENCY_BUCKETS_S,
)
INTER_TOKEN_LATENCY = Histogram(
    _PREFIX + "inter_token_latency_seconds",
    "Between consecutive tokens of a request: one observation per token after the first.",
    buckets=_TOKEN_GAP_BUCKETS_S,
)
# Observed per message: in batches (see BatchedHistogram), flushed at each request's end.
_TOKEN_GAPS = BatchedHistogram(INTER_TOKEN_LATENCY)
E2E_REQUEST_LATENCY = Histogram(
    _PREFIX + "e2e_request_latency_seconds", "Request accepted to its last message (finished requests).",
    buckets=_LATENCY_BUCKETS_S,
)
REQUEST_QUEUE_TIME = Histogram(
    _PREFIX + "request_queue_time_seconds", "Time a request waited in its replica before its first step.",
    buckets=_LATENCY_BUCKETS_S,
)
REQUEST_PREPROCESS_TIME = Histogram(
    _PREFIX + "request_preprocess_time_seconds", "The preprocess hop of a finished request.",
    buckets=_LATENCY_BUCKETS_S,
)
PREPROCESSED_IN_GATEWAY = Counter(
    _PREFIX + "preprocessed_in_gateway",
    "Requests preprocessed in the gateway itself (a small prompt at light load: local_preprocess) instead of "
    "by the preprocess tier.",
)
PROMPT_TOKENS = Counter(_PREFIX + "prompt_tokens", "Prompt tokens of finished requests.")
COMPLETION_TOKENS = Counter(_PREFIX + "completion_tokens", "Completion tokens of finished requests.")
# By worker (`--workers N`): how the load spreads over them, by connection or, with
# --worker-ports, by call (worker_ports.py). Bound to this process's worker at start (bind_worker).
WORKER_COMPLETION_TOKENS = Counter(
    _PREFIX + "worker_completion_tokens", "Completion tokens of finished requests, by the gateway worker that served them.",
    ["worker"],
)
_worker_completion_tokens = WORKER_COMPLETION_TOKENS.labels(worker="0")
CACHED_PROMPT_TOKENS = Counter(
    _PREFIX + "cached_prompt_tokens", "Prompt tokens of finished requests served from a replica's prefix cache."
)
REQUESTS = Counter(_PREFIX + "requests", "Requests by how they ended.", ["finish_reason"])
REQUEST_ERRORS = Counter(_PREFIX + "request_errors", "Requests ended with a non-OK status.", ["code"])
STREAMS_IN_FLIGHT = Gauge(
    _PREFIX + "streams_in_flight", "Requests being served now.", multiprocess_mode="livesum"
)
CLIENT_DISCONNECTS = Counter(_PREFIX + "client_disconnects", "Clients that cancelled or went away mid-request.")
CLIENTS_NOT_READING = Counter(
    _PREFIX + "clients_not_reading",
    "Streams aborted because their client left output unread past a bound (gateway.slow_reader).", ["bound"],
)

_ROUTING_PREFIX = "llmserve_routing_"

ROUTING_DECISIONS = Counter(
    _ROUTING_PREFIX + "decisions", "Replica chosen for a request, and why.", ["replica", "reason"]
)
ROUTING_PREDICTED_CACHED_TOKENS = Counter(
    _ROUTING_PREFIX + "predicted_cached_tokens",
    "Prompt tokens the prefix index predicted the replica holds (requests whose usage inference reported).",
    ["replica"],
)
ROUTING_ACTUAL_CACHED_TOKENS = Counter(
    _ROUTING_PREFIX + "actual_cached_tokens",
    "Prompt tokens the replica served from its prefix cache (the same requests).",
    ["replica"],
)
ROUTING_FALLBACKS = Counter(
    _ROUTING_PREFIX + "fallbacks", "Requests the kv policy routed by load alone, and why.", ["cause"]
)
ROUTING_REROUTES = Counter(
    _ROUTING_PREFIX + "reroutes",
    "Requests a replica refused at admission (RESOURCE_EXHAUSTED) that were routed to another replica.",
    ["replica"],
)
# Every worker routes to the same replicas: the one that sees the most tells how many are up
# (a worker that is still starting sees none).
ROUTING_REPLICAS_LIVE = Gauge(
    _ROUTING_PREFIX + "replicas_live", "Replicas the gateway routes to.", multiprocess_mode="livemax"
)


# finish_reason label values: "abort" is a request cancelled before it finished, by its client
# or by an Abort; "error" is a request that ended with a non-OK status.
_ABORT = "abort"
_ERROR = "error"
_FINISHED = {
    FinishReason.STOP: REQUESTS.labels(FinishReason.STOP.value),
    FinishReason.LENGTH: REQUESTS.labels(FinishReason.LENGTH.value),
    FinishReason.CANCELLED: REQUESTS.labels(_ABORT),
    FinishReason.ERROR: REQUESTS.labels(_ERROR),
}
_ABORTED = _FINISHED[FinishReason.CANCELLED]
_FAILED = _FINISHED[FinishReason.ERROR]
_ERRORS_BY_CODE = {code: REQUEST_ERRORS.labels(code.name) for code in grpc.StatusCode}


def record_first_tokens(time_to_first_token_ns: int, num_tokens: int) -> None:
    """The first chunk of a request's tokens: TTFT, and a zero gap for each token it carries past the first."""
    TIME_TO_FIRST_TOKEN.observe(time_to_first_token_ns / _NS_PER_S)
    if num_tokens > 1:
        _TOKEN_GAPS.observe(0.0, num_tokens - 1)


def record_next_tokens(gap_ns: int, num_tokens: int) -> None:
    """A later chunk of `num_tokens` tokens, `gap_ns` after the previous one: the gap shared among
    its tokens, so the histogram's sum is first to last token and its count the tokens after the first."""
    _TOKEN_GAPS.observe(gap_ns / _NS_PER_S / num_tokens, num_tokens)


def record_finished(result: GenerationResult, *, is_reported_by_inference: bool) -> None:
    """A request's usage, timings and cached tokens once it has a result. Not `is_reported_by_inference`
    (a stop string ended it before inference's last message): its queue time and cached tokens are
    unknown, so neither the queue time nor the routing prediction is counted."""
    PROMPT_TOKENS.inc(result.num_prompt_tokens)
    COMPLETION_TOKENS.inc(result.num_completion_tokens)
    _worker_completion_tokens.inc(result.num_completion_tokens)
    CACHED_PROMPT_TOKENS.inc(result.num_cached_tokens)
    REQUEST_PREPROCESS_TIME.observe(result.preprocess_time_ns / _NS_PER_S)
    E2E_REQUEST_LATENCY.observe(result.total_time_ns / _NS_PER_S)
    if is_reported_by_inference:
        REQUEST_QUEUE_TIME.observe(result.queue_time_ns / _NS_PER_S)
        ROUTING_PREDICTED_CACHED_TOKENS.labels(result.replica_id).inc(result.predicted_cached_tokens)
        ROUTING_ACTUAL_CACHED_TOKENS.labels(result.replica_id).inc(result.num_cached_tokens)


def record_client_not_reading(bound: str) -> None:
    """A stream aborted by a slow-reader bound: "tokens" (unsent) or "time" (unread)."""
    CLIENTS_NOT_READING.labels(bound=bound).inc()


def record_route(replica: str, reason: str, fallback_cause: str | None) -> None:
    ROUTING_DECISIONS.labels(replica, reason).inc()
    if fallback_cause is not None:
        ROUTING_FALLBACKS.labels(fallback_cause).inc()


def record_preprocessed_in_gateway() -> None:
    PREPROCESSED_IN_GATEWAY.inc()


def record_reroute(refusing_replica: str) -> None:
    ROUTING_REROUTES.labels(refusing_replica).inc()


def record_replica_liveness(is_live: bool) -> None:
    """A replica became routable (True) or stopped being routable (False)."""
    if is_live:
        ROUTING_REPLICAS_LIVE.inc()
    else:
        ROUTING_REPLICAS_LIVE.dec()


@dataclass(slots=True)
class RequestOutcome:
    """How one request ended, as the servicer saw it; see `tracked_request`."""

    finish_reason: FinishReason | None = None  # set once its result is known


def bind_worker(worker_id: int) -> None:
    """Label this process's per-worker metrics with its worker id (gateway.app, at start)."""
    global _worker_completion_tokens
    _worker_completion_tokens = WORKER_COMPLETION_TOKENS.labels(worker=str(worker_id))


@contextlib.contextmanager
def tracked_request(context: grpc.aio.ServicerContext) -> Iterator[RequestOutcome]:
    """Count the request in flight while the block runs, then by how it ended: its result's finish
    reason (set on the outcome), the status code of the error it raised, or a disconnect.

    A cancel (grpc cancels the handler, or closes the stream's generator) is the client's unless
    the request's deadline has passed, which is DEADLINE_EXCEEDED.
    """
    outcome = RequestOutcome()
    STREAMS_IN_FLIGHT.inc()
    try:
        yield outcome
    except ServiceError as error:
        _record_error(error.code)
        raise
    except (asyncio.CancelledError, GeneratorExit):
        if outcome.finish_reason is not None:
            _FINISHED[outcome.finish_reason].inc()
        elif _is_past_deadline(context):
            _record_error(grpc.StatusCode.DEADLINE_EXCEEDED)
        else:
            _ABORTED.inc()
            CLIENT_DISCONNECTS.inc()
        raise
    except Exception:
        _record_error(grpc.StatusCode.INTERNAL)  # what the error-mapping interceptor answers
        raise
    else:
        if outcome.finish_reason is not None:
            _FINISHED[outcome.finish_reason].inc()
    finally:
        STREAMS_IN_FLIGHT.dec()
        _TOKEN_GAPS.flush()  # so that a scrape after the traffic stops sees all of it


def _record_error(code: grpc.StatusCode) -> None:
    _FAILED.inc()
    _ERRORS_BY_CODE[code].inc()


def _is_past_deadline(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0

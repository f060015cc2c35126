"""The preprocess service's Prometheus metrics (`llmserve_preprocess_*`, docs/observability.md),
on the default registry that --metrics-port serves. One observation of each per request, on
the event loop; label children are bound once (codes as they first occur, buckets at start)."""

from __future__ import annotations

import grpc
from prometheus_client import Counter, Histogram

from llmserve.buckets import LengthBucket

# From a short prompt on an idle tokenizer thread (~100 µs) to a long chat behind a full pool.
DURATION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_REQUESTS = Counter("llmserve_preprocess_requests", "Preprocess requests answered, by status code", ["code"])
_TOKENS = Counter("llmserve_preprocess_tokens", "Prompt tokens of the Preprocess requests answered OK")
_DURATION = Histogram(
    "llmserve_preprocess_tokenize_duration_seconds",
    "One Preprocess request answered OK, arrival to answer: checks, the wait for a tokenizer thread, "
    "rendering and tokenizing in its micro-batch, block hashes",
    buckets=DURATION_BUCKETS_S,
)
_BY_BUCKET = Counter(
    "llmserve_preprocess_requests_by_bucket", "Preprocess requests answered OK, by the length bucket", ["bucket"]
)
_PROMPT_CACHE_HITS = Counter(
    "llmserve_preprocess_prompt_cache_hits", "Chats that found a tokenized prefix, by where it was found", ["tier"]
)
_PROMPT_IDS_IN_REGION = Counter(
    "llmserve_preprocess_prompt_ids_in_region",
    "Prompts long enough for the shared-memory ring that the gateway asked for there, by outcome: "
    "written, or inline (the ring full of entries younger than their lease, or none could be made)",
    ["outcome"],
)

_OK = _REQUESTS.labels(code="OK")
_by_code: dict[grpc.StatusCode, Counter] = {}
_by_bucket: dict[int, Counter] = {}  # the bucket's max_prompt_tokens → its child
_MEMORY_HITS = _PROMPT_CACHE_HITS.labels(tier="memory")  # the in-process LRU
_REDIS_HITS = _PROMPT_CACHE_HITS.labels(tier="redis")


def expose_buckets(buckets: tuple[LengthBucket, ...]) -> None:
    """Bind a child per bucket at start, so each is exported (at 0) before its first request."""
    for bucket in buckets:
        _bucket_child(bucket)


def record_preprocessed(num_tokens: int, bucket: LengthBucket, duration_s: float) -> None:
    _OK.inc()
    _TOKENS.inc(num_tokens)
    _DURATION.observe(duration_s)
    _bucket_child(bucket).inc()


def record_failed(code: grpc.StatusCode) -> None:
    child = _by_code.get(code)
    if child is None:
        child = _by_code[code] = _REQUESTS.labels(code=code.name)
    child.inc()


def record_memory_hit() -> None:
    _MEMORY_HITS.inc()


def record_redis_hit() -> None:
    _REDIS_HITS.inc()


def _bucket_child(bucket: LengthBucket) -> Counter:
    child = _by_bucket.get(bucket.max_prompt_tokens)
    if child is None:
        child = _by_bucket[bucket.max_prompt_tokens] = _BY_BUCKET.labels(bucket=str(bucket.max_prompt_tokens))
    return child


IDS_WRITTEN_TO_REGION = _PROMPT_IDS_IN_REGION.labels(outcome="written")
IDS_INLINE_RING_FULL = _PROMPT_IDS_IN_REGION.labels(outcome="inline")

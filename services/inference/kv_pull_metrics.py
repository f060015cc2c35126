"""KV pull's Prometheus metrics (`llmserve_kv_pull_*`, `llmserve_kv_pin_*`; docs/observability.md).

The puller counts what it pulled and every pull that fell back to recomputing, by reason, so
a pair of replicas that should pull and recomputes instead shows it; the source counts the
blocks it pinned and the pins whose lease ended before their puller released them (a puller
that died or hung mid-pull).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from llmserve.inference.engine.kv_block_import import KvImport

# Reasons a pull fell back to recomputing (the label's values).
FAILURE_REASONS = (
    "source_unavailable",  # the source did not answer (gone, draining, timed out)
    "refused",  # the source refused to pin (no --kv-pull there, bad request)
    "nothing_cached",  # the source holds none of the prompt (evicted since the router looked)
    "evicted",  # the source holds fewer blocks than the hint said: the rest is recomputed
    "no_shared_memory",  # no shm or CUDA IPC path between the two (another host or container)
    "layout_mismatch",  # the pools differ (model, block size, KV dtype)
    "no_free_blocks",  # this replica had no free blocks to pull into
    "source_gone",  # the source's region could not be mapped (it died after pinning)
    "prefix_caching_off",
    "not_enabled",
    "engine",  # this replica's engine could not do it (no core calls, the core gone)
)

_PULLED_BLOCKS = Counter("llmserve_kv_pull_blocks", "KV blocks pulled from co-located replicas, by path", ["path"])
_PULLED_BYTES = Counter("llmserve_kv_pull_bytes", "Bytes of KV blocks pulled from co-located replicas, by path", ["path"])
_REGIONS_OPENED = Counter(
    "llmserve_kv_pull_regions_opened",
    "Source pools mapped, by path (once per source replica: one that climbs with the pulls means a mapping is not kept)",
    ["path"],
)
_FAILURES = Counter(
    "llmserve_kv_pull_failures", "KV pulls that recomputed some or all of the prefix instead, by reason", ["reason"]
)
_DURATION = Histogram(
    "llmserve_kv_pull_duration_seconds", "A pull: pin at the source, then import (the release is not waited for)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
# From a few blocks on a GPU (tens of microseconds) to a long prefix copied on a CPU.
_COPY_BUCKETS_S = (0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
_COPY = Histogram(
    "llmserve_kv_pull_copy_seconds", "A pull's copies alone, from the mapped source pool into ours",
    buckets=_COPY_BUCKETS_S,
)
_COPY_DEVICE = Histogram(
    "llmserve_kv_pull_copy_device_seconds", "A pull's copy kernel alone on the GPU (CUDA events around it; CUDA only)",
    buckets=_COPY_BUCKETS_S,
)
# Where a pull's time goes, at the puller: the PinKvBlocks round trip to the source ("pin": its
# server, its core between two of its steps, and back), the kv_import sent to our own core until
# it answers ("import": the core answers with the outputs of the pass that applied it, so this
# includes the step that follows, the request's first) and the core's own work on the import
# ("import_work": lookups, allocation, copies, registration; the copies alone are
# llmserve_kv_pull_copy_seconds). Only pin and import_work are on the first token's path beside
# the request's own step.
PHASES = ("pin", "import", "import_work")
_PHASE = Histogram(
    "llmserve_kv_pull_phase_seconds", "A pull's phases at the puller: pin (round trip to the source), import "
    "(sent to our engine core until answered, with the step after it), import_work (the core's own work on it)", ["phase"],
    buckets=(0.0001, 0.0003, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 1.0),
)
_PHASE_BY_NAME = {phase: _PHASE.labels(phase=phase) for phase in PHASES}
_PINNED_BLOCKS = Counter("llmserve_kv_pin_blocks", "KV blocks this replica pinned for pullers")
_LEASES_EXPIRED = Counter("llmserve_kv_pin_leases_expired", "Pins released by their lease, not by their puller")
for _reason in FAILURE_REASONS:
    _FAILURES.labels(reason=_reason)


def record_phase(phase: str, seconds: float) -> None:
    _PHASE_BY_NAME[phase].observe(seconds)


def record_pulled(imported: KvImport, duration_s: float) -> None:
    path = imported.path.value
    record_phase("import_work", imported.work_s)
    _PULLED_BLOCKS.labels(path=path).inc(imported.num_blocks)
    _PULLED_BYTES.labels(path=path).inc(imported.num_bytes)
    if imported.opened_region:
        _REGIONS_OPENED.labels(path=path).inc()
    _DURATION.observe(duration_s)
    if imported.num_blocks:
        _COPY.observe(imported.copy_s)
        if imported.copy_device_s is not None:
            _COPY_DEVICE.observe(imported.copy_device_s)


def record_failure(reason: str) -> None:
    _FAILURES.labels(reason=reason if reason in FAILURE_REASONS else "engine").inc()


def record_pinned(num_blocks: int) -> None:
    _PINNED_BLOCKS.inc(num_blocks)


def record_lease_expired() -> None:
    _LEASES_EXPIRED.inc()

"""The transport's Prometheus metrics (`llmserve_transport_*`, docs/observability.md), counted by
the consumer, in the process that reads (the producer of a transfer may be in another service).

By path, so that a fallback is visible: a co-located pair that should map each other's memory
and instead shows `path="inline"` has lost its shared /dev/shm or its IPC namespace.
"""

from __future__ import annotations

from prometheus_client import Counter

from llmserve.tensor_transport.messages import TransportPath

_TRANSFERS = Counter(
    "llmserve_transport_transfers", "Tensors received through the tensor transport, by path", ["path"]
)
_BYTES = Counter("llmserve_transport_bytes", "Bytes of tensors received through the tensor transport, by path", ["path"])
_REGIONS_OPENED = Counter(
    "llmserve_transport_regions_opened",
    "Regions a consumer mapped (once per region and connection: one that climbs with the transfers "
    "means a mapping is not being kept)",
    ["path"],
)
# Bound once: labels() costs a dict lookup and a lock per call.
_TRANSFERS_BY_PATH = {path: _TRANSFERS.labels(path=path.value) for path in TransportPath}
_BYTES_BY_PATH = {path: _BYTES.labels(path=path.value) for path in TransportPath}
_OPENED_BY_PATH = {path: _REGIONS_OPENED.labels(path=path.value) for path in TransportPath}


def record_transfer(path: TransportPath, num_bytes: int) -> None:
    _TRANSFERS_BY_PATH[path].inc()
    _BYTES_BY_PATH[path].inc(num_bytes)


def record_region_opened(path: TransportPath) -> None:
    _OPENED_BY_PATH[path].inc()

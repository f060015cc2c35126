"""The HTTP /metrics endpoint every service serves with --metrics-port (Prometheus text format).

prometheus-client's own server runs on a daemon thread beside the gRPC event loop: scrapes are
rare and small, and a thread keeps them off the loop that streams tokens. Metric names are in
docs/observability.md.

A service that runs its work in several processes (the gateway's `--workers N`) serves their
sum from the parent: `shared_metrics` gives the children a directory to write their values to
(prometheus-client's multiprocess mode) and the parent a registry that adds them up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from typing import Iterator

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import CollectorRegistry

from llmserve.observability import ObservabilityConfig

log = logging.getLogger(__name__)

# Where prometheus-client, in a process that imports it with this set, keeps every value (one
# file per process and kind) instead of in memory.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def start_metrics_endpoint(
    config: ObservabilityConfig, host: str, registry: CollectorRegistry = REGISTRY
) -> int | None:
    """Serve `registry` at http://host:PORT/metrics when configured; the bound port, or None when off."""
    if config.metrics_port is None:
        return None
    server, _thread = start_http_server(config.metrics_port, addr=host, registry=registry)
    port = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, port)
    return port


class SharedMetrics:
    """The metrics of the processes started while `shared_metrics` is open, summed."""

    def __init__(self, directory: str):
        self._directory = directory
        # Only the children's files: the parent's own values (it imported prometheus-client before
        # the directory existed) stay in its default registry, unserved.
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=directory)

    def mark_process_dead(self, pid: int) -> None:
        """A child exited: its live gauges (in flight, live replicas) stop counting; its counters stay."""
        mark_process_dead(pid, self._directory)


@contextlib.contextmanager
def shared_metrics() -> Iterator[SharedMetrics]:
    """A fresh directory in PROMETHEUS_MULTIPROC_DIR for the processes spawned inside the block.

    Children must be *spawned* (a new interpreter that imports prometheus-client with the variable
    set, which is when it picks file storage), not forked from a process that already imported it.
    The directory is removed, and the variable restored, on exit.
    """
    directory = tempfile.mkdtemp(prefix="llmserve-metrics-")
    previous = os.environ.get(MULTIPROC_DIR_ENV)
    os.environ[MULTIPROC_DIR_ENV] = directory
    try:
        yield SharedMetrics(directory)
    finally:
        if previous is None:
            del os.environ[MULTIPROC_DIR_ENV]
        else:
            os.environ[MULTIPROC_DIR_ENV] = previous
        shutil.rmtree(directory, ignore_errors=True)

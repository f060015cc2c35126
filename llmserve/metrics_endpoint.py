"""The HTTP /metrics endpoint every service serves with --metrics-port (Prometheus text format).

prometheus-client's own server runs on a daemon thread beside the gRPC event loop: scrapes are
rare and small, and a thread keeps them off the loop that streams tokens. Metric names are in
docs/observability.md.
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.registry import CollectorRegistry

from llmserve.observability import ObservabilityConfig

log = logging.getLogger(__name__)


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

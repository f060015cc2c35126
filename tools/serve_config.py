"""`llmserve serve`'s flags and the ServeConfig they make, built once and handed to the launcher.

The engine flags are the inference service's own (llmserve.inference.engine_flags): serve takes
each of them and passes on those that differ from the default.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmserve.config_checks import check_at_least
from llmserve.gateway.slow_reader import SlowReaderBounds
from llmserve.gateway.slow_reader_flags import add_slow_reader_arguments, slow_reader_bounds
from llmserve.gateway.stream_interval import StreamInterval, add_stream_interval_arguments, check_stream_interval, stream_interval_from_args
from llmserve.gateway.worker_ports import check_worker_ports
from llmserve.inference.engine.config import MODEL_GROUP
from llmserve.inference.engine_flags import (
    EngineOptions,
    add_engine_arguments,
    default_engine_options,
    engine_options,
)
from llmserve.observability import LOG_FORMATS
from llmserve.preprocess.config import DEFAULT_MAX_OUTPUT_TOKENS
from llmserve.server_flags import DEFAULT_GRACE_PERIOD_S, DEFAULT_HOST, GATEWAY_PORT, HTTP_PORT, LOG_LEVELS

# Per service: weight loading and CUDA-graph capture take a while.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
# One gateway worker per 4 cores, 1 to 8: each can use a core (9-12k output tokens/s per core
# measured on the H200 at 256 streams), and inference and preprocess need theirs.
CORES_PER_GATEWAY_WORKER = 4
MAX_DEFAULT_GATEWAY_WORKERS = 8


def default_gateway_workers() -> int:
    """Gateway worker processes for this machine's cores (1 on a small box)."""
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_GATEWAY_WORKERS, num_cores // CORES_PER_GATEWAY_WORKER))


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str | None = None  # None/"default": the default model; else a checkpoint dir or .gguf
    model_name: str | None = None
    cache_dir: Path | None = None  # converted-model cache (None: model_store's default)
    host: str = DEFAULT_HOST
    port: int = GATEWAY_PORT  # the gateway's public port; 0 picks a free one
    http_port: int | None = HTTP_PORT  # the gateway's OpenAI-compatible HTTP API; None: off
    log_level: str = "INFO"
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    max_output_tokens: int | None = None  # None: preprocess's default
    gateway_workers: int = field(default_factory=default_gateway_workers)
    # Each gateway worker's own port, worker i on this + i (0: free ports), for clients that
    # spread calls over them (gateway.worker_ports); None: none.
    gateway_worker_ports: int | None = None
    num_replicas: int = 1  # inference replicas behind the gateway, routed by their KV events
    # Set: /metrics of the gateway on this port, preprocess on the next, replica i on the next + i.
    metrics_port: int | None = None
    log_format: str = "text"  # of every service (docs/observability.md)
    log_prompts: bool = False
    slow_readers: SlowReaderBounds = SlowReaderBounds()  # the gateway's (gateway.slow_reader)
    stream_interval: StreamInterval = StreamInterval()  # the gateway's (gateway.stream_interval)
    # The inference engine's options by EngineConfig field name, every flagged field present.
    engine: EngineOptions = field(default_factory=default_engine_options)

    def __post_init__(self) -> None:
        check_at_least("--replicas", self.num_replicas, 1)
        if self.http_port is not None and not 1 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be a port number (1 to 65535; --no-http for none), got {self.http_port}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535 - 1 - self.num_replicas:
            raise ValueError(f"--metrics-port must leave room for every service's port, got {self.metrics_port}")
        check_stream_interval(self.stream_interval, self.slow_readers.max_unread_s)
        check_worker_ports(self.gateway_worker_ports, self.gateway_workers, self.port, None)

    @property
    def stop_timeout_s(self) -> float:
        """How long a child may take to drain after SIGTERM before it is killed."""
        return self.grace_period_s + 5.0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group(MODEL_GROUP)
    model.add_argument(
        "--model", default="default", metavar="default|DIR|FILE.gguf",
        help="'default' (SmolLM2-135M-Instruct, fetched and converted on first use), an HF checkpoint "
        "directory or a .gguf file (default: %(default)s)",
    )
    model.add_argument("--model-name", metavar="NAME", help="name clients use for the model (default: the model's own)")
    model.add_argument(
        "--cache-dir", type=Path, metavar="DIR",
        help="where converted models are kept (default: $LLMSERVE_CACHE_DIR or ~/.cache/llmserve)",
    )
    add_engine_arguments(p, {MODEL_GROUP: model})
    server = p.add_argument_group("serving")
    server.add_argument(
        "--host", default=DEFAULT_HOST,
        help="gateway bind address; 0.0.0.0 accepts remote clients (default: %(default)s)",
    )
    server.add_argument(
        "--port", type=int, default=GATEWAY_PORT, help="gateway port; 0 picks a free one (default: %(default)s)"
    )
    server.add_argument(
        "--http-port", type=int, default=HTTP_PORT, metavar="PORT",
        help="the gateway's OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) "
        "on --host:PORT (default: %(default)s)",
    )
    server.add_argument("--no-http", action="store_true", help="serve gRPC only: no HTTP API")
    server.add_argument(
        "--gateway-workers", type=int, default=default_gateway_workers(), metavar="N",
        help="gateway processes sharing the port; each uses up to a core, about one per 8k output "
        "tokens/s (default: one per 4 cores, 1 to 8: %(default)s here)",
    )
    server.add_argument(
        "--gateway-worker-ports", type=int, metavar="BASE",
        help="also give gateway worker i a port of its own, BASE + i (0: free ports, shown at start), so that "
        "a client can spread its calls over the workers: grpc's round_robin over ipv4:HOST:BASE,HOST:BASE+1,... "
        "(default: off; the shared port spreads connections, not calls)",
    )
    server.add_argument(
        "--replicas", type=int, default=1, metavar="N",
        help="inference replicas; the gateway routes each request to the one holding most of its prompt in "
        "KV cache (docs/routing.md). With --device cuda, replica i runs on cuda:i; any other device is "
        "shared, so size each replica's KV pool (--kv-memory-fraction) to fit (default: %(default)s)",
    )
    server.add_argument(
        "--metrics-port", type=int, metavar="PORT",
        help="Prometheus /metrics of the gateway on PORT, preprocess on PORT+1, inference replica i on "
        "PORT+2+i (docs/observability.md; default: none)",
    )
    server.add_argument(
        "--max-output-tokens", type=int, metavar="TOKENS",
        help=f"largest max_tokens accepted (default: preprocess's, {DEFAULT_MAX_OUTPUT_TOKENS})",
    )
    add_slow_reader_arguments(server)
    add_stream_interval_arguments(server)
    server.add_argument(
        "--log-level", default="INFO", choices=LOG_LEVELS,
        help="log level of the launcher and all services (default: %(default)s)",
    )
    server.add_argument(
        "--log-format", default="text", choices=LOG_FORMATS,
        help="the services' log lines: json is one object per line, with the request id (default: %(default)s)",
    )
    server.add_argument(
        "--log-prompts", action="store_true",
        help="let the services log prompt and completion text at DEBUG (off: they may hold personal data)",
    )
    server.add_argument(
        "--grace-period-s", type=float, default=DEFAULT_GRACE_PERIOD_S, metavar="SECONDS",
        help="on stop, how long in-flight requests may finish (default: %(default)s)",
    )
    server.add_argument(
        "--startup-timeout-s", type=float, default=DEFAULT_STARTUP_TIMEOUT_S, metavar="SECONDS",
        help="how long each service may take to become ready (default: %(default)s)",
    )


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig for parsed `llmserve serve` flags."""
    return ServeConfig(
        model=args.model,
        model_name=args.model_name,
        cache_dir=args.cache_dir,
        host=args.host,
        port=args.port,
        http_port=None if args.no_http else args.http_port,
        log_level=args.log_level,
        grace_period_s=args.grace_period_s,
        startup_timeout_s=args.startup_timeout_s,
        max_output_tokens=args.max_output_tokens,
        gateway_workers=args.gateway_workers,
        gateway_worker_ports=args.gateway_worker_ports,
        num_replicas=args.replicas,
        metrics_port=args.metrics_port,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
        slow_readers=slow_reader_bounds(args),
        stream_interval=stream_interval_from_args(args),
        engine=engine_options(args),
    )

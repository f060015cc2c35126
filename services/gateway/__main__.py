"""`python -m llmserve.gateway`: the public API in front of preprocess and inference.

Start-up: wait (bounded) for a preprocess server and the inference replicas to report SERVING →
check that their block layouts agree (exit 1 naming both values if not) → read the model card →
bind → SERVING → write the port file.
SIGTERM/SIGINT: NOT_SERVING → drain in-flight requests → exit 0. With `--workers N` (N > 1) this
process runs N such gateways as children on its port (gateway.worker_group).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmserve.gateway.config import (
    DEFAULT_ACCEPT_LOOPS, DEFAULT_DOWNSTREAM_READY_TIMEOUT_S, DEFAULT_PROMPT_IDS_REGION_FROM, GatewayConfig,
)
from llmserve.gateway.connection_age import DEFAULT_MAX_CONNECTION_AGE_S
from llmserve.gateway.discovery import Target
from llmserve.gateway.local_preprocess import add_local_preprocess_arguments, local_preprocess_config
from llmserve.gateway.slow_reader_flags import add_slow_reader_arguments, slow_reader_bounds
from llmserve.gateway.stream_interval import add_stream_interval_arguments, stream_interval_from_args
from llmserve.gateway.routing_flags import add_routing_arguments, routing_options
from llmserve.gateway.worker import run_worker
from llmserve.gateway.worker_group import run_worker_group
from llmserve.gateway.worker_ports import add_worker_ports_arguments
from llmserve.server import configure_logging, exit_with_parent, write_port_file
from llmserve.metrics_endpoint import start_metrics_endpoint
from llmserve.server_flags import GATEWAY_PORT, add_server_arguments, server_options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmserve.gateway",
        description="llmserve gateway: the public gRPC API (llmserve.v1.GatewayService). It mints request "
        "ids, sends each request through preprocess and inference, and streams text back.",
    )
    server = add_server_arguments(parser, default_port=GATEWAY_PORT)
    server.add_argument(
        "--workers", type=int, default=1, metavar="N",
        help="gateway processes sharing the port (SO_REUSEPORT: the kernel spreads connections over them); "
        "each uses up to a core, about one per 8k output tokens/s (default: %(default)s)",
    )
    add_worker_ports_arguments(server)
    server.add_argument(
        "--max-connection-age-s", type=float, default=DEFAULT_MAX_CONNECTION_AGE_S, metavar="SECONDS",
        help="ask a client connection to go after about this long (gRPC: HTTP/2 GOAWAY, its streams in "
        "flight finish; HTTP: `Connection: close` on its next response), so that clients connect again and "
        "spread again over --workers and over gateway pods added since; 0 never (default: %(default)s)",
    )
    server.add_argument(
        "--accept-loops", type=int, default=DEFAULT_ACCEPT_LOOPS, metavar="N",
        help="gRPC servers per gateway process on the port, each accepting the new requests of the "
        "connections the kernel gives it: grpc's asyncio server accepts one request at a time, a few trips "
        "through an event loop that is busy streaming tokens, so a burst of new streams waits in line for "
        "its first token; more loops accept in parallel (default: %(default)s)",
    )
    server.add_argument(
        "--http-port", type=int, default=None, metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
        "/health) on this port, on --host; 0 picks a free one (default: off)",
    )
    parser.add_argument(
        "--preprocess",
        required=True,
        action="append",
        metavar="HOST:PORT|dns:///NAME:PORT",
        help="preprocess servers (repeatable, as --inference): each request goes to the one with the fewest "
        "calls in flight that reports SERVING, and one refused UNAVAILABLE is sent once more to another",
    )
    parser.add_argument(
        "--inference",
        required=True,
        action="append",
        metavar="HOST:PORT|dns:///NAME:PORT",
        help="inference replicas (repeatable): HOST:PORT is one replica; dns:///NAME:PORT is every address "
        "NAME resolves to (a Kubernetes headless Service), resolved again every --resolve-interval-s",
    )
    parser.add_argument(
        "--model", required=True, metavar="DIR", help="model checkpoint dir (its tokenizer.json detokenizes output)"
    )
    parser.add_argument(
        "--model-name", default=None, help="name clients pass as GenerateParams.model (default: inference's)"
    )
    parser.add_argument(
        "--downstream-ready-timeout-s",
        type=float,
        default=DEFAULT_DOWNSTREAM_READY_TIMEOUT_S,
        metavar="SECONDS",
        help="at start, how long to wait for preprocess and inference to report SERVING (default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-ids-region-from", type=int, default=DEFAULT_PROMPT_IDS_REGION_FROM, metavar="TOKENS",
        help="a prompt of at least this many tokens has its ids put in preprocess's shared-memory ring when "
        "that preprocess shares /dev/shm with this gateway (one host, pod or container), and replicas that share "
        "it too read them there: the messages carry a reference instead of 4 bytes per token; below it bytes "
        "cost less (docs/transport.md); 0: never (default: %(default)s)",
    )
    add_slow_reader_arguments(parser)
    add_stream_interval_arguments(parser)
    add_local_preprocess_arguments(parser)
    add_routing_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        preprocess_targets=tuple(Target.parse(text) for text in args.preprocess),
        inference_targets=tuple(Target.parse(text) for text in args.inference),
        model_path=Path(args.model).expanduser().resolve(),
        model_name=args.model_name,
        **server_options(args),
        log_level=args.log_level,
        downstream_ready_timeout_s=args.downstream_ready_timeout_s,
        num_workers=args.workers,
        worker_base_port=args.worker_ports,
        worker_ports_file=args.worker_ports_file,
        num_accept_loops=args.accept_loops,
        max_connection_age_s=args.max_connection_age_s,
        http_port=args.http_port,
        slow_readers=slow_reader_bounds(args),
        stream_interval=stream_interval_from_args(args),
        local_preprocess=local_preprocess_config(args),
        prompt_ids_region_from=args.prompt_ids_region_from,
        **routing_options(args),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    configure_logging("gateway", config.log_level, config.observability)
    exit_with_parent()
    if config.num_workers > 1:
        return run_worker_group(config)  # it serves the workers' metrics, summed
    start_metrics_endpoint(config.observability, config.host)

    def on_serving(port: int, own_port: int | None) -> None:
        if own_port is not None:
            write_port_file(config.worker_ports_file, [own_port])
        write_port_file(config.port_file, port)

    return run_worker(config, 0, on_serving=on_serving)


if __name__ == "__main__":
    sys.exit(main())

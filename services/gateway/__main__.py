"""`python -m llmserve.gateway`: the public API in front of preprocess and inference.

Start-up: wait (bounded) for both hops to report SERVING → check that their block layouts agree
(exit 1 naming both values if not) → read the model card → bind → SERVING → write the port file.
SIGTERM/SIGINT: NOT_SERVING → drain in-flight requests → exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from llmserve.errors import ServiceError
from llmserve.gateway.app import start_gateway
from llmserve.gateway.block_layout import BlockLayoutMismatch
from llmserve.gateway.config import DEFAULT_DOWNSTREAM_READY_TIMEOUT_S, GatewayConfig
from llmserve.server import configure_logging, exit_with_parent, serve_until_signal, write_port_file
from llmserve.server_flags import GATEWAY_PORT, add_server_arguments, server_options

log = logging.getLogger("llmserve.gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmserve.gateway",
        description="llmserve gateway: the public gRPC API (llmserve.v1.GatewayService). It mints request "
        "ids, sends each request through preprocess and inference, and streams text back.",
    )
    add_server_arguments(parser, default_port=GATEWAY_PORT)
    parser.add_argument("--preprocess", required=True, metavar="HOST:PORT", help="preprocess service address")
    parser.add_argument(
        "--inference",
        required=True,
        action="append",
        metavar="HOST:PORT",
        help="inference replica address (repeatable; the first one is used for now)",
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
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        preprocess_address=args.preprocess,
        inference_addresses=tuple(args.inference),
        model_path=Path(args.model).expanduser().resolve(),
        model_name=args.model_name,
        **server_options(args),
        log_level=args.log_level,
        downstream_ready_timeout_s=args.downstream_ready_timeout_s,
    )


async def serve(config: GatewayConfig) -> None:
    gateway = await start_gateway(config)
    write_port_file(config.port_file, gateway.port)
    try:
        await serve_until_signal(gateway.server, grace_s=config.grace_period_s)
    finally:
        await gateway.close_clients()


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(build_parser().parse_args(argv))
    configure_logging("gateway", config.log_level)
    exit_with_parent()
    try:
        asyncio.run(serve(config))
    except ServiceError as error:  # a hop never became ready
        log.error("%s", error.message)
        return 1
    except BlockLayoutMismatch as error:  # preprocess and inference were started differently
        log.error("cannot start: %s", error)
        return 1
    except KeyboardInterrupt:  # interrupted during start-up, before the signal handlers exist
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

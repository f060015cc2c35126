"""The command-line contract of every service: the flags they all take and their defaults.

The launcher (llmserve.tools.launcher) starts its children with these flags, and `llmserve serve`
and the client commands take their defaults from here, so each value is defined once.
"""

from __future__ import annotations

import argparse

from llmserve.observability import LOG_FORMATS, ObservabilityConfig

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_HOST = "127.0.0.1"
# On SIGTERM, how long in-flight requests may take to finish before they are aborted.
DEFAULT_GRACE_PERIOD_S = 10.0
# The well-known ports: clients find the gateway here; 0 (the inference default) picks a free one.
GATEWAY_PORT = 50051
# The OpenAI-compatible HTTP API's port under `llmserve serve` (the port OpenAI-compatible servers use).
HTTP_PORT = 8000
PREPROCESS_PORT = 50052


def add_server_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_port: int = 0,
) -> argparse._ArgumentGroup:
    """Add the flags every service takes: --host, --port, --port-file, --log-level, --grace-period-s,
    and those of what it shows an operator (--metrics-port, --log-format, --log-prompts).

    They are the launcher's contract with its children (see llmserve.tools.launcher), so they are
    defined once. Returns the "server" group, for service-specific server flags (--replica-id).
    """
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s)")
    group.add_argument(
        "--port", type=int, default=default_port, help="port to bind; 0 picks a free one (default: %(default)s)"
    )
    group.add_argument(
        "--port-file", metavar="PATH",
        help="write the bound port here once loading is done and health is SERVING (for launchers and tests)",
    )
    group.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
        help="DEBUG logs one line per request (default: %(default)s)",
    )
    group.add_argument(
        "--grace-period-s", type=float, default=DEFAULT_GRACE_PERIOD_S, metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight requests may take to finish before they are "
        "aborted (default: %(default)s)",
    )
    _add_observability_arguments(parser)
    return group


def _add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("observability")
    group.add_argument(
        "--metrics-port", type=int, metavar="PORT",
        help="serve Prometheus metrics over HTTP at :PORT/metrics (0 picks a free port and logs it; "
        "default: no metrics endpoint)",
    )
    group.add_argument(
        "--log-format", default="text", choices=LOG_FORMATS,
        help="json: one JSON object per line, with the request id on every line of a request "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--log-prompts", action="store_true",
        help="include prompt and completion text in logs (off: they may hold personal data)",
    )


def observability_options(args: argparse.Namespace) -> ObservabilityConfig:
    return ObservabilityConfig(
        metrics_port=args.metrics_port, log_format=args.log_format, log_prompts=args.log_prompts
    )


def server_options(args: argparse.Namespace) -> dict:
    """The values of the flags every service config shares (host, port, port file, grace, observability)."""
    return {
        "host": args.host,
        "port": args.port,
        "port_file": args.port_file,
        "grace_period_s": args.grace_period_s,
        "observability": observability_options(args),
    }

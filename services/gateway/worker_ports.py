"""`--worker-ports BASE`: besides the shared port, each gateway worker listens on a port of its own.

Why: the shared port spreads connections (SO_REUSEPORT hashes each to a worker), and a grpc
client sends every call of a channel on one connection, so a few busy clients can load one worker
and leave another idle: with 64 client connections over 8 workers on the H200, the busiest worker
used 1.75-3.2x the CPU of the idlest (docs/benchmarks.md). No worker can take over another's
streams (a token's cost is the write on the connection that carries it), so the spreading has to
happen where calls are placed: in the client. With a port per worker, a client that connects to
all of them and places each call on the next connection (grpc's `round_robin` over
`ipv4:HOST:P0,HOST:P1,...`; llmserve.call_balancing) spreads its calls evenly over the workers.

Worker i listens on BASE + i; BASE 0 gives each a free port. `--worker-ports-file PATH` is where
the gateway writes them, once every worker serves (llmserve.server.write_port_file: the ports in
worker order, space-separated; llmserve.call_balancing.balanced_target makes the client's target
of them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

MAX_PORT = 65535


def add_worker_ports_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--worker-ports", type=int, default=None, metavar="BASE",
        help="also listen on a port of each worker's own, BASE + i for worker i (0: free ports), so that a "
        "client can spread its calls over the workers by call rather than by connection: grpc's round_robin "
        "policy over the target ipv4:HOST:BASE,HOST:BASE+1,... (default: off)",
    )
    parser.add_argument(
        "--worker-ports-file", default=None, metavar="PATH",
        help="with --worker-ports, write the workers' ports here once all serve (one line, worker order)",
    )


def check_worker_ports(base: int | None, num_workers: int, port: int, ports_file: str | None) -> None:
    """ValueError for a base whose range leaves the port numbers or holds the shared port."""
    if base is None:
        if ports_file:
            raise ValueError("worker_ports_file needs worker_ports (--worker-ports)")
        return
    if base < 0 or base + num_workers - 1 > MAX_PORT:
        raise ValueError(f"worker_ports must be 0 or a base with base + workers - 1 <= {MAX_PORT}, got {base}")
    if base and port and base <= port < base + num_workers:
        raise ValueError(f"worker_ports {base}..{base + num_workers - 1} hold the shared port {port}")


def own_address(host: str, base: int | None, worker_id: int) -> str | None:
    """The address of worker `worker_id`'s own port (port 0: a free one); None without `base`."""
    if base is None:
        return None
    return f"{host}:{base + worker_id if base else 0}"


def read_worker_ports(path: str | Path) -> list[int]:
    """The ports a --worker-ports-file lists, in worker order."""
    return [int(port) for port in Path(path).read_text().split()]

"""A client channel that spreads its calls over several servers by call, not by connection.

A grpc channel to one address keeps one connection and sends every call on it, so whatever
balances connections (the kernel over a gateway's `--workers`, a Kubernetes Service over pods)
balances a client once, when it connects. Given several addresses (`ipv4:A:P0,A:P1,...`, grpc's
static resolver; a gateway's `--worker-ports` gives one per worker), grpc's `round_robin` policy
connects to each and sends each call on the next: calls, not connections, are spread. grpc's
C-core, Java and Go clients take the same service config, so a client in any language can do it.

round_robin places calls only on connections that are ready, so the calls a new channel sends
at once all go to whichever worker answered first. A client that starts a burst
(bench/bench_stack.py, `llmserve bench`) first calls ListModels until every worker has answered
(`reach_every_worker`); a long-lived client spreads evenly once its connections are up.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import time

import grpc

from llmserve.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)

# Initial metadata naming the gateway worker process that served a call (gateway.worker_group):
# what a client, or a bench, reads to see how its calls were spread.
WORKER_METADATA_KEY = "x-gateway-worker"

ROUND_ROBIN_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


def balanced_target(host: str, ports: list[int] | tuple[int, ...]) -> str:
    """grpc's target for `host` on each of `ports` (a name is resolved here: the static
    resolver takes numeric addresses only)."""
    if not ports:
        raise ValueError("balanced_target needs at least one port")
    address = ipaddress.ip_address(_numeric(host.strip("[]")))
    if address.version == 6:
        return "ipv6:" + ",".join(f"[{address}]:{port}" for port in ports)
    return "ipv4:" + ",".join(f"{address}:{port}" for port in ports)


def balancing_options(target: str) -> tuple[tuple[str, str], ...]:
    """The channel options that spread calls over `target`'s addresses: those it lists
    (`ipv4:`/`ipv6:` with several), or every address a `dns:` name resolves to (a Kubernetes
    headless Service of gateway pods: the chart's `<release>-llmserve-gateway-pods`); none for
    one address."""
    if target.startswith(("ipv4:", "ipv6:")) and "," in target or target.startswith("dns:"):
        return (("grpc.service_config", ROUND_ROBIN_SERVICE_CONFIG),)
    return ()


def _numeric(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


async def reach_every_worker(channel: grpc.aio.Channel, target: str, timeout_s: float = 10.0) -> int:
    """Call the gateway's ListModels on `channel` until every address `target` lists has answered
    (each a worker: its `x-gateway-worker`), at most `timeout_s`; how many answered. A `dns:`
    name's addresses are not known here: one answer does."""
    num_addresses = target.count(",") + 1
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    workers: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(workers) < num_addresses and time.monotonic() < deadline:
        call = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=timeout_s)
        try:
            await call
        except grpc.aio.AioRpcError as error:  # the calls that follow will say it too, as their status
            log.warning("could not reach the gateway at %s: %s", target, error.code().name)
            return len(workers)
        workers.add(dict(await call.initial_metadata()).get(WORKER_METADATA_KEY, ""))
        if len(workers) < num_addresses:
            await asyncio.sleep(0.001)  # the other connections are still being made
    if len(workers) < num_addresses:
        log.warning("%d of the %d addresses of %s answered within %g s", len(workers), num_addresses, target, timeout_s)
    return len(workers)

"""llmserve.call_balancing: the target and options of a channel that spreads calls over several
ports (a gateway's --worker-ports; tests/test_gateway_workers.py runs it against real workers)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from llmserve.call_balancing import ROUND_ROBIN_SERVICE_CONFIG, balanced_target, balancing_options, reach_every_worker


def test_the_target_lists_every_port_on_a_numeric_address():
    assert balanced_target("127.0.0.1", [5001, 5002]) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert balanced_target("[::1]", (7000, 7001)) == "ipv6:[::1]:7000,[::1]:7001"
    assert balanced_target("localhost", [9]).split(":", 1)[0] in ("ipv4", "ipv6")  # resolved here
    with pytest.raises(ValueError, match="at least one port"):
        balanced_target("127.0.0.1", [])


def test_only_a_target_of_several_addresses_or_a_dns_name_is_balanced_by_call():
    for several in ("ipv4:127.0.0.1:1,127.0.0.1:2", "dns:///rel-llmserve-gateway-pods.ns.svc:50051"):
        assert balancing_options(several) == (("grpc.service_config", ROUND_ROBIN_SERVICE_CONFIG),)
    for one in ("127.0.0.1:50051", "ipv4:127.0.0.1:1", "localhost:1,2"):
        assert balancing_options(one) == ()


def test_reaching_workers_that_do_not_listen_gives_up_with_a_warning(caplog):
    """Nothing listens: the first call fails (UNAVAILABLE), none answered, and the load that
    follows reports the failure as its status, not a crash of the client."""
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    target = balanced_target("127.0.0.1", ports)

    async def reach() -> int:
        async with grpc.aio.insecure_channel(target, options=balancing_options(target)) as channel:
            return await reach_every_worker(channel, target, timeout_s=5.0)

    assert asyncio.run(reach()) == 0
    assert "could not reach the gateway at ipv4:127.0.0.1:" in caplog.text

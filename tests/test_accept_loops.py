"""Several accept loops on one port (llmserve.server.create_server's num_accept_loops, the
gateway's --accept-loops): every loop's server answers on the port the first one bound, the
kernel spreads connections over them, they share one health status, and stop() stops them all."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.gateway.config import GatewayConfig
from llmserve.server import create_server

SERVICE, METHOD = "llmserve.test.Which", "Get"
NUM_LOOPS = 3
NUM_CONNECTIONS = 24  # all on one of 3 sockets by chance: 3 x (1/3)^24, about 1e-11


def register_numbered(servers_seen: list[int]):
    """A register callback whose k-th server answers Get with k."""

    def register(server: grpc.aio.Server) -> None:
        number = len(servers_seen)
        servers_seen.append(number)

        async def which(request: bytes, context) -> bytes:
            return str(number).encode()

        handler = grpc.unary_unary_rpc_method_handler(which)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))

    return register


async def test_every_accept_loop_serves_the_one_port_with_one_health_and_stops_together():
    servers_seen: list[int] = []
    running = await create_server("127.0.0.1:0", register_numbered(servers_seen), (SERVICE,),
                                  max_receive_bytes=1024, num_accept_loops=NUM_LOOPS)
    assert servers_seen == list(range(NUM_LOOPS)) and len(running.more_servers) == NUM_LOOPS - 1
    # A channel per connection (its own subchannel pool), as separate clients have.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", options=options) for _ in range(NUM_CONNECTIONS)]
    try:
        answers = await asyncio.gather(*(channel.unary_unary(f"/{SERVICE}/{METHOD}")(b"", timeout=10) for channel in channels))
        assert len(set(answers)) > 1, answers  # more than one loop's server was given connections
        assert set(answers) <= {str(number).encode() for number in servers_seen}

        async def statuses() -> set[int]:
            checks = (health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
                      for channel in channels)
            return {response.status for response in await asyncio.gather(*checks)}

        assert await statuses() == {health_pb2.HealthCheckResponse.NOT_SERVING}  # as create_server leaves it
        await running.set_serving(True)
        assert await statuses() == {health_pb2.HealthCheckResponse.SERVING}  # every loop, one status

        await running.stop(None)
        for channel in channels[:4]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary(f"/{SERVICE}/{METHOD}")(b"", timeout=2)
            assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        await running.stop(None)
        await asyncio.gather(*(channel.close() for channel in channels))


def test_the_gateway_needs_at_least_one_accept_loop(tmp_path):
    with pytest.raises(ValueError, match="num_accept_loops"):
        GatewayConfig(preprocess_targets=("127.0.0.1:1",), inference_targets=("127.0.0.1:2",), model_path=tmp_path,
                      num_accept_loops=0)

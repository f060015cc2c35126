"""Waiting at start-up for a hop to report SERVING on grpc.health.v1."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.errors import Unavailable


async def wait_until_serving(channel: grpc.aio.Channel, service: str, timeout_s: float) -> None:
    """Poll grpc health until the server says SERVING; raise Unavailable after `timeout_s`."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    delay_s = 0.05
    last_problem = "no answer yet"
    while True:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last_problem = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except grpc.aio.AioRpcError as error:
            last_problem = f"{error.code().name}: {error.details()}"
        time_left_s = deadline - time.monotonic()
        if time_left_s <= 0:
            raise Unavailable(f"{service} not serving after {timeout_s:.0f}s ({last_problem})")
        await asyncio.sleep(min(delay_s, time_left_s))
        delay_s = min(delay_s * 2, 1.0)

"""Reading an AsyncEngine in tests, bounded so that a bug fails a test instead of hanging it."""

from __future__ import annotations

import asyncio
import time

from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.types import EngineOutput, EngineRequest

HANG_GUARD_S = 60.0


async def collect(engine: AsyncEngine, request: EngineRequest) -> list[EngineOutput]:
    """Every output of the request."""

    async def consume():
        return [output async for output in engine.generate(request)]

    return await asyncio.wait_for(consume(), HANG_GUARD_S)


async def wait_until(predicate) -> None:
    """Poll a condition the engine makes true shortly."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)

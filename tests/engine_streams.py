"""Reading an AsyncEngine in tests, bounded so that a bug fails a test instead of hanging it."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from llmserve.engine_output import EngineOutput
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.types import EngineRequest
from llmserve.inference.output_stream import OutputStream

HANG_GUARD_S = 60.0


async def generate(engine: AsyncEngine, request: EngineRequest) -> AsyncIterator[EngineOutput]:
    """The request's outputs as GenerateTokens reads them (an OutputStream of one request):
    coalesced per sequence, until every sequence has ended. Leaving early (break + aclose,
    cancellation) detaches it, which aborts it in the core."""
    stream = OutputStream(engine)
    stream.start(request)
    try:
        async for output in stream.outputs():
            yield output
    finally:
        stream.close()


async def collect(engine: AsyncEngine, request: EngineRequest) -> list[EngineOutput]:
    """Every output of the request."""

    async def consume():
        return [output async for output in generate(engine, request)]

    return await asyncio.wait_for(consume(), HANG_GUARD_S)


async def wait_until(predicate) -> None:
    """Poll a condition the engine makes true shortly."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)

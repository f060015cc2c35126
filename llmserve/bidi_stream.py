"""The body of a bidirectional-streaming handler whose requests a task of its own reads while
the call's task yields the responses (Multiplex, PreprocessStream): reading never waits for a
response to be written, and a response never waits for the next request to arrive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Response = TypeVar("Response")


async def served(
    read: Awaitable[None], responses: AsyncIterator[Response], close: Callable[[], None]
) -> AsyncIterator[Response]:
    """Yield `responses` while a task runs `read`; once they end, surface what ended the reading
    (it ends when the caller ends its side). Always: the reading stops and `close` runs."""
    reader = asyncio.create_task(read)
    try:
        async for response in responses:
            yield response
        await reader
    finally:
        reader.cancel()
        close()

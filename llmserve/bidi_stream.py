"""Both ends of our bidirectional streams (Multiplex, PreprocessStream).

Server: the handler's body, whose requests a task of its own reads (`read_requests`) while the
call's task yields the responses (`served`): reading never waits for a response to be written,
and a response never waits for the next request to arrive. Client: one writer task drains a
queue into the call (`write_queued`), since grpc.aio allows one write in flight per call and
requests start from many tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from llmserve.errors import ServiceError, check_decoded

log = logging.getLogger(__name__)

Request = TypeVar("Request")
Response = TypeVar("Response")


async def read_requests(requests: AsyncIterator[Request], handle: Callable[[Request], None]) -> ServiceError | None:
    """`handle` every message the caller sends until it ends its side; the error a message that
    cannot be read (unparsable, or over the receive limit) ends the reading with, else None."""
    try:
        async for request in requests:
            check_decoded(request)
            handle(request)
    except ServiceError as error:
        return error
    return None


async def write_queued(call: grpc.aio.StreamStreamCall, queued: asyncio.Queue, what: str) -> None:
    """Write what is put on `queued` to `call`, in order, until the call ends."""
    try:
        while True:
            await call.write(await queued.get())
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
        log.debug("%s write ended: %s", what, error)


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

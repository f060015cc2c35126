"""Which request the code running now serves, so that every log line about it names it.

The id lives in a contextvars.ContextVar. asyncio copies the context into every task it creates,
and grpc.aio runs each RPC in a task of its own, so an id bound in an RPC handler labels every
line of that RPC, those of the tasks it starts included, and no other RPC's. Threads started
with asyncio.to_thread inherit it too; threads of an executor (loop.run_in_executor) do not.

Two things break that default and are handled here: one task serving many requests (a Multiplex
stream: `serving_request` around each request's part), and a task started by one request but
shared by many (a Multiplex connection, a micro-batch: `context_without_request`).

A request id a client sends (to preprocess or inference directly) labels every line of its
request and may be named in its errors, so it is at most MAX_REQUEST_ID_BYTES
(`check_request_id`, at each service's door) and a label never longer, even one bound before
that check ran.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Iterator

from llmserve.client_text import num_bytes
from llmserve.errors import InvalidArgument

# Ids are the gateway's uuid4 hex (32 characters) or a caller's own: room for a prefix and a
# uuid, and a bound on what every log line of the request carries.
MAX_REQUEST_ID_BYTES = 128

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def bind_request_id(request_id: str) -> None:
    """Label every line the current task logs from now on: in an RPC handler, the rest of the RPC.

    Never reset: a handler that is an async generator may be closed from another task (asyncio
    finalises an abandoned generator in a new one), where resetting would raise; the binding ends
    with the RPC's task anyway.
    """
    _request_id.set(_label(request_id))


@contextlib.contextmanager
def serving_request(request_id: str) -> Iterator[None]:
    """Label the lines logged inside the block, for a task that serves many requests in turn.

    The block must not be left open across a `yield` of an async generator (see bind_request_id).
    """
    token = _request_id.set(_label(request_id))
    try:
        yield
    finally:
        _request_id.reset(token)


def check_request_id(request_id: str) -> None:
    """A client's request id is refused over MAX_REQUEST_ID_BYTES (not named: it is too long)."""
    if num_bytes(request_id) > MAX_REQUEST_ID_BYTES:
        raise InvalidArgument(
            "request_id", f"{num_bytes(request_id)} bytes exceeds the limit of {MAX_REQUEST_ID_BYTES} bytes"
        )


def _label(request_id: str) -> str:
    """The id as lines carry it: an id too long to be served is labelled by its first bytes."""
    if len(request_id) <= MAX_REQUEST_ID_BYTES // 4 or num_bytes(request_id) <= MAX_REQUEST_ID_BYTES:
        return request_id
    return request_id.encode("utf-8", "surrogatepass")[:MAX_REQUEST_ID_BYTES].decode("utf-8", "ignore")


def context_without_request() -> contextvars.Context:
    """A copy of the current context with no request bound, for `create_task(..., context=)` of a
    task that serves many requests: started from the first one's task, it would otherwise label
    all its lines with that request."""
    context = contextvars.copy_context()
    context.run(_request_id.set, None)
    return context


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to each record logged while a request is bound. Installed on the handler,
    so that it sees the records of every logger; an id passed with `extra=` is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = _request_id.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True

"""How long a client's connection to the gateway lives: `--max-connection-age-s`.

A gRPC client keeps one HTTP/2 connection and sends every call on it, so whatever spreads load
by connection (the kernel over `--workers` with SO_REUSEPORT, a Kubernetes Service over gateway
pods) spreads it once, when the client connects: a worker that drew two busy clients keeps them,
and a pod the autoscaler adds gets no share of the clients already connected. The cost of a
token is the write to its client, which only the process holding the connection can do, so no
worker can take over another's streams; the connection has to move.

So after about `max_connection_age_s` (grpc adds ±10% jitter) the server sends GOAWAY: calls in
flight on the connection finish undisturbed (the grace is unbounded: a generation may take
minutes), and the client's next call opens a new connection, placed afresh. Over a few ages
each worker's share of the clients evens out. What it costs a client: one connect (TCP and
HTTP/2 set-up, ~1 ms on one host) per age.

The HTTP face (openai_http.py) ages its keep-alive connections the same way: the first response
prepared on a connection past its age says `Connection: close` and the connection closes after
it, so the client's next request connects again. Said in the headers, never by closing an idle
connection, which a client may be sending a (non-idempotent) POST on at that moment.
"""

from __future__ import annotations

import random
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # aiohttp is imported only where the HTTP face is served
    from aiohttp import web

# Minutes: short enough that a scaled-out gateway takes its share of the clients soon, long
# enough that a reconnection is rare next to the calls a connection carries.
DEFAULT_MAX_CONNECTION_AGE_S = 300.0

# grpc's largest grace (its argument is a 32-bit count of ms): a call in flight is never cut.
_UNBOUNDED_GRACE_MS = 2**31 - 1


def connection_age_options(max_connection_age_s: float) -> tuple[tuple[str, int], ...]:
    """grpc server arguments for `max_connection_age_s` (0: connections live as long as their clients)."""
    if not max_connection_age_s:
        return ()
    return (
        ("grpc.max_connection_age_ms", max(1, round(max_connection_age_s * 1000))),
        ("grpc.max_connection_age_grace_ms", _UNBOUNDED_GRACE_MS),
    )


def age_http_connections(app: web.Application, max_connection_age_s: float) -> None:
    """Close each of `app`'s keep-alive connections after its response that is prepared once it
    is about `max_connection_age_s` old (±10%, as grpc's); 0: never."""
    if not max_connection_age_s:
        return
    # transport → when its connection is due to go; weak, so closed connections drop out
    due_s: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    rng = random.Random()

    async def close_when_aged(request: web.BaseRequest, response: web.StreamResponse) -> None:
        transport = request.transport
        if transport is None:  # the client is already gone
            return
        now_s = time.monotonic()
        due = due_s.get(transport)
        if due is None:
            due_s[transport] = now_s + max_connection_age_s * rng.uniform(0.9, 1.1)
        elif now_s >= due:
            # Closed once this response is sent, and said in its headers (aiohttp computed them
            # before this hook; it writes them after).
            response.force_close()
            response.headers["Connection"] = "close"

    app.on_response_prepare.append(close_when_aged)

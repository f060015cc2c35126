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
"""

from __future__ import annotations

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

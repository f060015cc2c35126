"""The bounds on a stream whose client does not read, and the error it ends with.

What the gateway can see of a client's reading: its handler takes a request's outputs from the
replica stream's buffer (replica_stream.MultiplexedTokens) only when its previous write returned,
and a write returns as soon as the message is inside the client's HTTP/2 receive window. So
outputs wait in the buffer only once that window is full, and two things bound them there:
how many tokens wait (`max_unsent_tokens`: a fast replica fills it in seconds) and how long the
oldest has waited (`max_unread_s`: a slow replica, 2.5 tokens/s on a 2-core CPU, would take
minutes to reach any token bound). Past either, the request is aborted on the replica (its KV
blocks freed at once) and its stream ends with ClientNotReading.

What the gateway cannot see: messages that are inside the window. The window is the client's
(its SETTINGS and WINDOW_UPDATEs); no option of the gateway's server changes it. grpc's C-core
clients start at 64 KiB and, with BDP probing on (their default), grow it as data arrives, to
about 4 MiB measured, whether or not the application reads (docs/reliability.md, "Slow readers").
A client that never reads is bounded from the moment its window is full, not before; until
then it costs the replica what a reader of the same request does (bench/bench_slow_reader.py:
0.95-1.02x of a reader's time on an H100 and a CPU), and its request ends at its own max_tokens
or deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from llmserve.config_checks import check_at_least
from llmserve.errors import ServiceError

# A sequence decodes at up to a few hundred tokens/s on a GPU, so this is several seconds of a
# client not reading there: long enough for a GC pause or a slow link, short enough to free a
# stalled client's KV.
DEFAULT_MAX_UNSENT_TOKENS = 2048
# Outputs wait only while the client's window is full; a client that reads takes them within a
# round trip and a GC pause. 20 s leaves room for a stalled network path, and a stream whose
# client stopped reading holds its KV blocks at most this long after its window filled.
DEFAULT_MAX_UNREAD_S = 20.0


@dataclass(frozen=True, slots=True)
class SlowReaderBounds:
    """When a stream's client counts as not reading; 0 turns a bound off."""

    max_unsent_tokens: int = DEFAULT_MAX_UNSENT_TOKENS  # tokens waiting for the client to take them
    max_unread_s: float = DEFAULT_MAX_UNREAD_S  # seconds the oldest waiting output has waited

    def __post_init__(self) -> None:
        check_at_least("max_unsent_tokens", self.max_unsent_tokens, 0, " (0: no bound)")
        check_at_least("max_unread_s", self.max_unread_s, 0, " (0: no bound)")


class ClientNotReading(ServiceError):
    """The client left output unread past a bound: its request was aborted.

    RESOURCE_EXHAUSTED, not ABORTED: the stream exhausted its per-stream buffer quota and the
    client is the cause (ABORTED means a concurrency conflict that a retry resolves; retrying
    this request without reading faster fails the same way, so no RetryInfo is attached either).
    `bound` names which bound it passed ("tokens" or "time"), for the metric.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, bound: str, detail: str):
        super().__init__(f"client is not reading: {detail}")
        self.bound = bound

    @classmethod
    def too_many_tokens(cls, num_unsent_tokens: int, max_unsent_tokens: int) -> ClientNotReading:
        return cls("tokens", f"{num_unsent_tokens} tokens unsent (limit {max_unsent_tokens})")

    @classmethod
    def unread_too_long(cls, max_unread_s: float, num_unsent_tokens: int) -> ClientNotReading:
        return cls(
            "time", f"output unread for {max_unread_s:g} s (the limit), {num_unsent_tokens} tokens unsent"
        )

"""The stream interval: the least time between two messages the gateway writes on one client
stream while the worker is busy (`--stream-interval-ms`, `--stream-interval-min-streams`, the
gateway's and `llmserve serve`'s).

Why: a gateway worker's cost is per message, not per token (issue 19: grpc's write, its
`sendmsg` and the poller's wake-ups are most of a worker's profile), and a stream decoding a
token every few milliseconds gets a message for each. With an interval the tokens that arrive
while a stream waits go out together in its next message, so the messages, and the worker's
CPU, fall by the tokens per message (on the H200 at 256 streams, 10 ms: 2.4 tokens per message,
0.77x the gateway's CPU, 15k tokens/s per core; docs/benchmarks.md). What it costs: a token
waits up to the interval before it is written (SGLang's `--stream-interval` makes the same trade
in tokens; an interval in time bounds the wait on a slow model as on a fast one).

When: only while the worker has at least `min_streams` requests in flight on the replica's
stream, counted at each take. A lightly loaded worker has CPU to spare and nothing to gain, so
there every output goes out as it arrives, as with no interval at all; under load the interval
holds. The first message of a stream is never held back, so the time to the first token is
unchanged; the final one may wait for the interval.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from llmserve.config_checks import check_at_least

DEFAULT_STREAM_INTERVAL_MS = 10.0
# At 16 streams a worker writes ~4,000 messages/s at the 1.5B shape's ~4 ms steps, about 40% of
# a core at the ~90 µs a message measured there (11k tokens/s per core, a token a message); below that the interval would only add delay.
DEFAULT_MIN_STREAMS = 16


@dataclass(frozen=True)
class StreamInterval:
    interval_s: float = DEFAULT_STREAM_INTERVAL_MS / 1000
    min_streams: int = DEFAULT_MIN_STREAMS

    def __post_init__(self) -> None:
        check_at_least("stream_interval_s", self.interval_s, 0, " (0: none)")
        check_at_least("stream_interval_min_streams", self.min_streams, 1)

    def at(self, num_streams: int) -> float:
        """The interval a take waits out with `num_streams` requests in flight (0: none)."""
        return self.interval_s if num_streams >= self.min_streams else 0.0

    def always(self) -> float:
        """The interval whatever the load (for a buffer whose streams nothing counts)."""
        return self.interval_s

    def describe(self) -> str:
        """For the gateway's start-up line: whether, and from what load, tokens wait."""
        if not self.interval_s:
            return "every output written as it arrives"
        return f"{self.interval_s * 1000:g} ms between a stream's messages from {self.min_streams} streams in flight"


NO_INTERVAL = StreamInterval(0.0)


def add_stream_interval_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        default=DEFAULT_STREAM_INTERVAL_MS,
        metavar="MS",
        help="while the worker is busy (--stream-interval-min-streams), the least time between two "
        "messages of one client stream: tokens that arrive meanwhile go out together in the next, "
        "which saves the gateway CPU per token at the cost of up to this much added delay per token "
        "(the first token is never held); 0: every output as it arrives (default: %(default)s)",
    )
    parser.add_argument(
        "--stream-interval-min-streams",
        type=int,
        default=DEFAULT_MIN_STREAMS,
        metavar="N",
        help="the interval holds only while the worker has at least N requests in flight on the "
        "replica's stream; below, every output goes out as it arrives; 1: always (default: %(default)s)",
    )


def stream_interval_from_args(args: argparse.Namespace) -> StreamInterval:
    """The interval the flags ask for (ValueError for values out of range)."""
    return StreamInterval(args.stream_interval_ms / 1000, args.stream_interval_min_streams)


def check_stream_interval(interval: StreamInterval, max_unread_s: float) -> None:
    """ValueError for an interval that the slow-reader time bound would take for a client not
    reading (outputs wait in the buffer for the interval)."""
    if max_unread_s and interval.interval_s >= max_unread_s:
        raise ValueError(f"stream_interval_s must be below max_unread_s ({max_unread_s:g} s), got {interval.interval_s:g}")


def stream_interval_argv(interval: StreamInterval) -> list[str]:
    """The gateway flags for `interval` (what `llmserve serve` passes on)."""
    return ["--stream-interval-ms", str(interval.interval_s * 1000), "--stream-interval-min-streams", str(interval.min_streams)]

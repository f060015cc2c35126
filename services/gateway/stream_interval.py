"""The stream interval: the least time between two messages the gateway writes on one client
stream (`--stream-interval-ms`, the gateway's and `llmserve serve`'s). 0, the default: every
output goes out as it arrives, a message per token while the client keeps up.

Why: a gateway worker's cost is per message, not per token (issue 19: grpc's write, its
`sendmsg` and the poller's wake-ups are most of a worker's profile), and a stream decoding a
token every few milliseconds gets a message for each. With an interval the tokens that arrive
while a stream waits go out together in its next message, so the messages, and the worker's
CPU, fall by the tokens per message. What it costs: a token waits up to the interval before it
is written (SGLang's `--stream-interval` makes the same trade in tokens; an interval in time
bounds the wait on a slow model as on a fast one). The first message of a stream is never held
back, so the time to the first token is unchanged; the final one may wait for the interval.
"""

from __future__ import annotations

import argparse

from llmserve.config_checks import check_at_least

DEFAULT_STREAM_INTERVAL_MS = 0.0


def add_stream_interval_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        default=DEFAULT_STREAM_INTERVAL_MS,
        metavar="MS",
        help="least time between two messages of one client stream: tokens that arrive meanwhile go "
        "out together in the next, which saves the gateway CPU per token at the cost of up to this "
        "much added delay per token (the first token is never held); 0: every output as it arrives "
        "(default: %(default)s)",
    )


def stream_interval_s(args: argparse.Namespace) -> float:
    """The interval the flag asks for, in seconds (the configs check it)."""
    return args.stream_interval_ms / 1000


def check_stream_interval(interval_s: float, max_unread_s: float) -> None:
    """ValueError for a negative interval, or one that the slow-reader time bound would take
    for a client not reading (outputs wait in the buffer for the interval)."""
    check_at_least("stream_interval_s", interval_s, 0, " (0: none)")
    if max_unread_s and interval_s >= max_unread_s:
        raise ValueError(f"stream_interval_s must be below max_unread_s ({max_unread_s:g} s), got {interval_s:g}")


def stream_interval_argv(interval_s: float) -> list[str]:
    """The gateway flag for `interval_s` (what `llmserve serve` passes on)."""
    return ["--stream-interval-ms", str(interval_s * 1000)]

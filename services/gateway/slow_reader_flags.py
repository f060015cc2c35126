"""The slow-reader flags (gateway.slow_reader), shared by the gateway and `llmserve serve`."""

from __future__ import annotations

import argparse

from llmserve.gateway.slow_reader import DEFAULT_MAX_UNREAD_S, DEFAULT_MAX_UNSENT_TOKENS, SlowReaderBounds


def add_slow_reader_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--max-unsent-tokens",
        type=int,
        default=DEFAULT_MAX_UNSENT_TOKENS,
        metavar="TOKENS",
        help="a stream whose client leaves more tokens than this unread (beyond what its HTTP/2 window "
        "holds) is aborted with RESOURCE_EXHAUSTED; 0: no bound (default: %(default)s)",
    )
    parser.add_argument(
        "--max-unread-s",
        type=float,
        default=DEFAULT_MAX_UNREAD_S,
        metavar="SECONDS",
        help="a stream whose output has waited this long for its client to take it (its HTTP/2 window "
        "is full and it does not read) is aborted with RESOURCE_EXHAUSTED, whatever the tokens; "
        "0: no bound (default: %(default)s)",
    )


def slow_reader_bounds(args: argparse.Namespace) -> SlowReaderBounds:
    """The bounds the flags ask for (ValueError naming a negative one)."""
    return SlowReaderBounds(max_unsent_tokens=args.max_unsent_tokens, max_unread_s=args.max_unread_s)


def slow_reader_argv(bounds: SlowReaderBounds) -> list[str]:
    """The gateway flags for `bounds` (what `llmserve serve` passes on)."""
    return ["--max-unsent-tokens", str(bounds.max_unsent_tokens), "--max-unread-s", str(bounds.max_unread_s)]

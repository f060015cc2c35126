"""`python -m llmserve.preprocess`: serve the Preprocess service for one model.

Flags → one frozen PreprocessConfig → load tokenizer and template → bind → health SERVING →
port file → serve until SIGTERM/SIGINT → NOT_SERVING → drain → exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path

from llmserve.block_hash import DEFAULT_BLOCK_SIZE
from llmserve.buckets import DEFAULT_BUCKET_BOUNDS, LENGTH_BUCKETS_FLAG, BucketConfig
from llmserve.preprocess.config import (
    DEFAULT_INLINE_MAX_PROMPT_BYTES,
    DEFAULT_MAX_BATCH_PROMPTS,
    DEFAULT_MAX_IN_FLIGHT_PROMPT_BYTES,
    DEFAULT_MAX_OUTPUT_TOKENS,
    DEFAULT_PROMPT_CACHE_BYTES,
    DEFAULT_PROMPT_IDS_LEASE_S,
    DEFAULT_PROMPT_IDS_REGION_MIB,
    DEFAULT_REDIS_TIMEOUT_MS,
    DEFAULT_REDIS_TTL_S,
    PreprocessConfig,
)
from llmserve.cores import available_cores
from llmserve.preprocess.server import start_server
from llmserve.preprocessing.text_pieces import add_text_pieces_argument
from llmserve.server import BindError, configure_logging, exit_with_parent, serve_until_signal
from llmserve.metrics_endpoint import start_metrics_endpoint
from llmserve.server_flags import PREPROCESS_PORT, add_server_arguments, observability_options, server_options

log = logging.getLogger("llmserve.preprocess")


def _buckets(text: str) -> BucketConfig:
    try:
        return BucketConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected increasing token counts like 128,512,2048: {exc}") from exc


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmserve.preprocess",
        description="Preprocess service: renders chat templates, tokenizes and validates requests "
        "for one model, and reports each prompt's length bucket and prefix block hashes.",
    )
    parser.add_argument(
        "--model", required=True, metavar="DIR",
        help="HF checkpoint directory; tokenizer.json, tokenizer_config.json (chat template, special "
        "tokens) and config.json (context length, EOS) are read from it once at start",
    )
    parser.add_argument("--model-name", metavar="NAME", help="name reported by GetPreprocessInfo (default: the checkpoint's own name)")
    add_server_arguments(parser, default_port=PREPROCESS_PORT)
    parser.add_argument(
        "--block-size", dest="block_size_tokens", type=_positive_int, default=DEFAULT_BLOCK_SIZE, metavar="TOKENS",
        help="tokens per block for prefix block hashes; must equal the inference engine's block size "
        "(default: %(default)s)",
    )
    parser.add_argument(
        LENGTH_BUCKETS_FLAG, dest="length_buckets", type=_buckets, default=BucketConfig(DEFAULT_BUCKET_BOUNDS),
        metavar="N,N,...",
        help="length-bucket upper bounds in prompt tokens, increasing; cut at the context, whose length "
        "becomes the last bucket: the requests-by-bucket metric and GetPreprocessInfo; the same flag "
        f"and value as the inference engine's (default: {','.join(map(str, DEFAULT_BUCKET_BOUNDS))})",
    )
    parser.add_argument(
        "--max-output-tokens", type=_positive_int, default=DEFAULT_MAX_OUTPUT_TOKENS, metavar="TOKENS",
        help="largest max_tokens accepted, and the cap when a request leaves it unset "
        "(capped at the context minus one; default: %(default)s)",
    )
    parser.add_argument(
        "--max-context-tokens", type=_positive_int, metavar="TOKENS",
        help="prompt + output limit; may only lower the model's own context, e.g. to match an engine "
        "started with a shorter --max-context-tokens (default: the model's context)",
    )
    parser.add_argument(
        "--max-prompt-bytes", type=_positive_int, metavar="BYTES",
        help="refuse a prompt (or the chat turns together) over this many UTF-8 bytes before "
        "tokenizing it (default: the context x the longest token's bytes x 2, more than can fit); "
        "a message over it plus 64 KiB (or the context as token ids, if larger) is refused unparsed",
    )
    parser.add_argument(
        "--tokenizer-threads", dest="num_tokenizer_threads", type=_positive_int, default=available_cores(), metavar="N",
        help="threads that tokenize off the event loop, one micro-batch each at a time (default: the "
        "cores this process may use, from its cgroup CPU quota or CPU affinity: %(default)s)",
    )
    parser.add_argument(
        "--max-batch-prompts", type=_positive_int, default=DEFAULT_MAX_BATCH_PROMPTS, metavar="N",
        help="prompts tokenized in one call at most; requests that arrive while every tokenizer thread is busy "
        "are tokenized together (default: %(default)s)",
    )
    parser.add_argument(
        "--inline-max-prompt-bytes", type=int, default=DEFAULT_INLINE_MAX_PROMPT_BYTES, metavar="BYTES",
        help="process a prompt (text, chat or token ids) of up to this many bytes on the event loop when it "
        "arrives alone (no other prompt held, none started in the last 5 ms), saving the hand-off to a tokenizer "
        "thread and back (~0.3 ms on a 512-token prompt) on the first token's path; 0 sends every prompt to a "
        "thread (default: %(default)s)",
    )
    add_text_pieces_argument(parser)
    parser.add_argument(
        "--prompt-cache-bytes", type=int, default=DEFAULT_PROMPT_CACHE_BYTES, metavar="BYTES",
        help="tokenized chat prefixes kept in process (an LRU), so that a chat's next turn and "
        "conversations with a known system prompt tokenize only their new text; 0 turns it off "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-ids-region-mib", type=int, default=DEFAULT_PROMPT_IDS_REGION_MIB, metavar="MIB",
        help="a shared-memory ring in /dev/shm of this size for the ids of long prompts: a gateway "
        "on the same host asks for them there (its --prompt-ids-region-from), and relays a reference "
        "instead of the ids to replicas on the same host; made at the first such request; 0: none, "
        "ids always travel in the messages (default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-ids-lease-s", type=float, default=DEFAULT_PROMPT_IDS_LEASE_S, metavar="SECONDS",
        help="an entry of that ring is reused no sooner than this after it was written (a ring full "
        "of younger entries answers the ids inline) (default: %(default)s)",
    )
    parser.add_argument(
        "--redis-url", metavar="URL",
        help="share tokenized system prompts with other preprocess servers through this Redis, e.g. "
        "redis://host:6379/0 (default: none, in process only); a Redis that is down or slow only "
        "means tokenizing locally",
    )
    parser.add_argument(
        "--redis-timeout-ms", type=_positive_int, default=DEFAULT_REDIS_TIMEOUT_MS, metavar="MS",
        help="a Redis call slower than this is a miss; after a failure Redis is skipped for a second "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--redis-ttl-s", type=_positive_int, default=DEFAULT_REDIS_TTL_S, metavar="S",
        help="expiry of the entries written to Redis (default: %(default)s)",
    )
    parser.add_argument(
        "--max-in-flight-prompt-bytes", type=_positive_int, default=DEFAULT_MAX_IN_FLIGHT_PROMPT_BYTES,
        metavar="BYTES",
        help="prompt bytes held at once, waiting for a tokenizer thread or being tokenized; a request that does "
        "not fit is refused with RESOURCE_EXHAUSTED and a retry delay (default: %(default)s)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    """Each PreprocessConfig field from the flag that parses into its name (a flag whose name
    differs says dest=), then the model and the flags every service shares."""
    by_field_name = {f.name: getattr(args, f.name) for f in dataclasses.fields(PreprocessConfig) if hasattr(args, f.name)}
    return PreprocessConfig(**{**by_field_name, **server_options(args)}, model_path=Path(args.model))


async def _serve(config: PreprocessConfig) -> int:
    start_metrics_endpoint(config.observability, config.host)
    try:
        server = await start_server(config)
    except (FileNotFoundError, ValueError, BindError) as exc:
        # A bad model directory, flag combination or port: one line, no traceback.
        log.error("cannot start: %s", exc)
        return 1
    try:
        await serve_until_signal(server.running, grace_s=config.grace_period_s)
    finally:
        await server.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("preprocess", args.log_level, observability_options(args))
    exit_with_parent()
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return asyncio.run(_serve(config))


if __name__ == "__main__":
    sys.exit(main())

"""The stream interval (gateway.stream_interval): while the worker is busy a stream's outputs are
taken, and written, at most once per interval after the first, everything that arrived meanwhile
together, and no token is lost or reordered; while it is not, each output goes out as it arrives.
In process on a request's buffer, then on the real stack (torch backend, tiny model) through
GenerateStream."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from contextlib import aclosing

import grpc
import pytest

from llmserve.gateway.__main__ import build_parser, config_from_args
from llmserve.gateway.replica_stream import MultiplexedTokens
from llmserve.gateway.stream_interval import StreamInterval, stream_interval_argv, stream_interval_from_args
from llmserve.tools.serve_config import add_serve_arguments, serve_config_from_args
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2
from tests.procs import stack_fixture

GATEWAY_REQUIRED_ARGS = ["--preprocess", "127.0.0.1:1", "--inference", "127.0.0.1:2", "--model", "."]


async def takes_of(interval_s: float | Callable[[], float], num_tokens: int, push_every_s: float) -> tuple[list[list[int]], float]:
    """Tokens pushed every `push_every_s` into a request's buffer, the last one final, taken as
    fast as the buffer gives them: the tokens of each take, and the seconds from the first
    push to the last take."""
    interval = interval_s if callable(interval_s) else (lambda: interval_s)
    tokens = MultiplexedTokens("r", lambda request_id, abort: None, interval_s=interval)

    async def push() -> None:
        for token_id in range(num_tokens):
            finish = common_pb2.FINISH_REASON_LENGTH if token_id == num_tokens - 1 else common_pb2.FINISH_REASON_UNSPECIFIED
            tokens.push(inference_pb2.RequestOutput(
                request_id="r", output=inference_pb2.GenerateTokensResponse(token_ids=[token_id], finish_reason=finish),
            ))
            await asyncio.sleep(push_every_s)

    started_s = time.monotonic()
    pushing = asyncio.create_task(push())
    takes = []
    async with aclosing(tokens.__aiter__()) as outputs:
        async for output in outputs:
            takes.append(list(output.new_token_ids))
    await pushing
    return takes, time.monotonic() - started_s


def test_takes_come_at_most_once_per_interval_and_carry_every_token_in_order():
    interval_s = 0.1
    takes, elapsed_s = asyncio.run(takes_of(interval_s, num_tokens=60, push_every_s=0.005))
    assert [t for take in takes for t in take] == list(range(60))
    # the first take is not held back; each later one comes interval_s after the one before,
    # however late this machine runs the loop
    assert (len(takes) - 1) * interval_s <= elapsed_s
    assert len(takes) < 60 and max(len(take) for take in takes) > 1


def test_without_an_interval_each_output_is_taken_as_it_arrives():
    takes, _ = asyncio.run(takes_of(0.0, num_tokens=20, push_every_s=0.02))
    assert [t for take in takes for t in take] == list(range(20))
    assert len(takes) > 10  # a take per push, but for the ones a loaded machine ran late


def test_the_interval_follows_the_load_it_is_asked_at():
    takes, _ = asyncio.run(takes_of(StreamInterval(0.1, min_streams=2).always, num_tokens=30, push_every_s=0.005))
    assert len(takes) < 30
    load = {"streams": 1}
    interval = StreamInterval(0.1, min_streams=2)
    # one stream: no interval, a take per push (but for what a loaded machine runs late)
    takes, _ = asyncio.run(takes_of(lambda: interval.at(load["streams"]), num_tokens=20, push_every_s=0.02))
    assert len(takes) > 10 and [t for take in takes for t in take] == list(range(20))
    assert interval.at(1) == 0.0 and interval.at(2) == interval.at(64) == 0.1
    assert interval.describe() == "100 ms between a stream's messages from 2 streams in flight"
    assert StreamInterval(0.0).describe() == "every output written as it arrives"


def test_the_flags_default_to_10_ms_from_16_streams_and_llmserve_serve_passes_them_on():
    config = config_from_args(build_parser().parse_args(GATEWAY_REQUIRED_ARGS))
    assert config.stream_interval == StreamInterval(0.010, min_streams=16)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = serve_config_from_args(parser.parse_args(["--stream-interval-ms", "12.5", "--stream-interval-min-streams", "3"]))
    gateway_args = build_parser().parse_args([*GATEWAY_REQUIRED_ARGS, *stream_interval_argv(config.stream_interval)])
    assert stream_interval_from_args(gateway_args) == StreamInterval(0.0125, min_streams=3)


@pytest.mark.parametrize("argv, message", [
    (["--stream-interval-ms", "-1"], "stream_interval_s must be >= 0"),
    (["--stream-interval-min-streams", "0"], "stream_interval_min_streams must be >= 1"),
    (["--stream-interval-ms", "5000", "--max-unread-s", "2"], "stream_interval_s must be below max_unread_s (2 s)"),
])
def test_a_negative_interval_or_one_the_slow_reader_bound_would_take_is_refused(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_args(build_parser().parse_args([*GATEWAY_REQUIRED_ARGS, *argv]))


# --- the real stack ------------------------------------------------------------------------------

INTERVAL_S = 0.3
NUM_TOKENS = 24

# The interval holds from two streams in flight: one stream alone is the idle worker.
stack = stack_fixture(gateway_args=["--stream-interval-ms", str(INTERVAL_S * 1000), "--stream-interval-min-streams", "2"])
PARAMS = gateway_pb2.GenerateParams(
    prompt="The interval test", return_token_ids=True,
    sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True),
)


def _streamed(gateway) -> tuple[list[gateway_pb2.GenerateStreamResponse], float]:
    """One stream's messages and its seconds from the call to its end."""
    started_s = time.monotonic()
    messages = list(gateway.GenerateStream(gateway_pb2.GenerateStreamRequest(params=PARAMS), timeout=120))
    return messages, time.monotonic() - started_s


def _check_whole(gateway, messages) -> None:
    """The same greedy tokens and text as the whole answer at once: nothing lost or reordered."""
    whole = gateway.Generate(gateway_pb2.GenerateRequest(params=PARAMS), timeout=120)
    assert messages[-1].result.usage.completion_tokens == NUM_TOKENS
    assert [t for message in messages for t in message.token_ids] == list(whole.token_ids)
    assert "".join(message.text for message in messages) == whole.text


def test_busy_streams_get_every_token_in_no_more_messages_than_the_interval_allows(stack):
    gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack["gateway"].address))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = list(pool.map(lambda _: _streamed(gateway), range(2)))
    for messages, _ in streams:
        with_tokens = [message for message in messages if message.token_ids]
        # while both were in flight a message came INTERVAL_S after the one before it at least
        assert len(with_tokens) < NUM_TOKENS // 2
        _check_whole(gateway, messages)


def test_the_gateway_says_at_start_up_when_tokens_wait(stack):
    log_text = stack["gateway"].log_path.read_text()
    assert "; 300 ms between a stream's messages from 2 streams in flight" in log_text, log_text[-2000:]


def test_a_stream_alone_gets_each_output_as_it_arrives(stack):
    gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack["gateway"].address))
    messages, elapsed_s = _streamed(gateway)
    with_tokens = [message for message in messages if message.token_ids]
    # without the interval the 24 tokens would fit in 1 + elapsed / 0.3 messages only if they came late
    assert len(with_tokens) > max(NUM_TOKENS // 2, 1 + elapsed_s / INTERVAL_S)
    _check_whole(gateway, messages)

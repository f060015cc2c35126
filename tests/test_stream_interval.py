"""The stream interval (gateway.stream_interval): a stream's outputs are taken, and written, at
most once per interval after the first, everything that arrived meanwhile together, and no
token is lost or reordered. In process on a request's buffer, then on the real stack (torch
backend, tiny model) through GenerateStream."""

from __future__ import annotations

import argparse
import asyncio
import time
from contextlib import aclosing

import grpc
import pytest

from llmserve.gateway.__main__ import build_parser, config_from_args
from llmserve.gateway.replica_stream import MultiplexedTokens
from llmserve.gateway.stream_interval import stream_interval_argv, stream_interval_s
from llmserve.tools.serve_config import add_serve_arguments, serve_config_from_args
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2
from tests.procs import stack_fixture

GATEWAY_REQUIRED_ARGS = ["--preprocess", "127.0.0.1:1", "--inference", "127.0.0.1:2", "--model", "."]


async def takes_of(interval_s: float, num_tokens: int, push_every_s: float) -> tuple[list[list[int]], float]:
    """Tokens pushed every `push_every_s` into a request's buffer, the last one final, taken as
    fast as the buffer gives them: the tokens of each take, and the seconds from the first
    push to the last take."""
    tokens = MultiplexedTokens("r", lambda request_id, abort: None, interval_s=interval_s)

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


def test_the_flag_defaults_to_none_and_llmserve_serve_passes_it_on():
    assert config_from_args(build_parser().parse_args(GATEWAY_REQUIRED_ARGS)).stream_interval_s == 0.0
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = serve_config_from_args(parser.parse_args(["--stream-interval-ms", "12.5"]))
    gateway_args = build_parser().parse_args([*GATEWAY_REQUIRED_ARGS, *stream_interval_argv(config.stream_interval_s)])
    assert stream_interval_s(gateway_args) == pytest.approx(0.0125)


@pytest.mark.parametrize("argv, message", [
    (["--stream-interval-ms", "-1"], "stream_interval_s must be >= 0"),
    (["--stream-interval-ms", "5000", "--max-unread-s", "2"], "stream_interval_s must be below max_unread_s (2 s)"),
])
def test_a_negative_interval_or_one_the_slow_reader_bound_would_take_is_refused(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_args(build_parser().parse_args([*GATEWAY_REQUIRED_ARGS, *argv]))


# --- the real stack ------------------------------------------------------------------------------

INTERVAL_S = 0.3
NUM_TOKENS = 24

stack = stack_fixture(gateway_args=["--stream-interval-ms", str(INTERVAL_S * 1000)])


def test_a_stream_gets_every_token_in_no_more_messages_than_its_interval_allows(stack):
    gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack["gateway"].address))
    params = gateway_pb2.GenerateParams(
        prompt="The interval test", return_token_ids=True,
        sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True),
    )
    started_s = time.monotonic()
    messages = list(gateway.GenerateStream(gateway_pb2.GenerateStreamRequest(params=params), timeout=120))
    ended_s = time.monotonic()
    with_tokens = [message for message in messages if message.token_ids]
    # each message after the first was written INTERVAL_S after the one before it at least
    assert (len(with_tokens) - 1) * INTERVAL_S <= ended_s - started_s
    assert len(with_tokens) < NUM_TOKENS and messages[-1].result.usage.completion_tokens == NUM_TOKENS
    # the same greedy tokens and text as the whole answer at once: nothing lost or reordered
    whole = gateway.Generate(gateway_pb2.GenerateRequest(params=params), timeout=120)
    assert [t for message in messages for t in message.token_ids] == list(whole.token_ids)
    assert "".join(message.text for message in messages) == whole.text

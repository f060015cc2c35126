"""A client that stops reading is bounded by time as well as by tokens (gateway.slow_reader).

In process: a request's buffer whose outputs wait untaken past `max_unread_s` aborts the
request, and one that is taken in time does not. On the real stack (torch backend, tiny model
with a long context): a client that never reads, with a window small enough to fill at once, is
aborted within the configured bound, its KV freed, its status saying which bound; with the
defaults it is aborted too, and a client that reads slowly is not.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from contextlib import aclosing

import grpc
import pytest

from llmserve.gateway.__main__ import build_parser
from llmserve.gateway.metrics import CLIENTS_NOT_READING
from llmserve.gateway.replica_stream import MultiplexedTokens
from llmserve.gateway.slow_reader import (
    DEFAULT_MAX_UNREAD_S,
    DEFAULT_MAX_UNSENT_TOKENS,
    ClientNotReading,
    SlowReaderBounds,
)
from llmserve.gateway.slow_reader_flags import slow_reader_argv, slow_reader_bounds
from llmserve.tools.serve_config import add_serve_arguments, serve_config_from_args
from llmserve.v1 import gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.long_streams import MAX_TOKENS, SMALL_WINDOW, long_context_model_dir, params  # noqa: F401 (a fixture)
from tests.procs import stack_fixture

REQUEST_ID = "r1"


def token_output(token_id: int) -> inference_pb2.RequestOutput:
    return inference_pb2.RequestOutput(
        request_id=REQUEST_ID, output=inference_pb2.GenerateTokensResponse(token_ids=[token_id])
    )


async def push_then_take(bounds: SlowReaderBounds, *, num_outputs: int, push_interval_s: float,
                         take_interval_s: float) -> tuple[list[tuple[str, bool]], list[int]]:
    """Outputs pushed every `push_interval_s`, taken every `take_interval_s`: what the buffer
    asked of the stream (forget, abort) and the token ids taken."""
    forgotten: list[tuple[str, bool]] = []
    tokens = MultiplexedTokens(REQUEST_ID, lambda request_id, abort: forgotten.append((request_id, abort)), bounds)
    taken: list[int] = []

    async def push() -> None:
        for token_id in range(num_outputs):
            if forgotten:
                return
            tokens.push(token_output(token_id))
            await asyncio.sleep(push_interval_s)

    pushing = asyncio.create_task(push())
    try:
        async with aclosing(tokens.__aiter__()) as outputs:
            async for output in outputs:
                taken.extend(output.new_token_ids)
                if len(taken) >= num_outputs:
                    break
                await asyncio.sleep(take_interval_s)
    finally:
        pushing.cancel()
    return forgotten, taken


def test_output_left_untaken_past_the_time_bound_aborts_the_request():
    before = CLIENTS_NOT_READING.labels(bound="time")._value.get()
    bounds = SlowReaderBounds(max_unsent_tokens=0, max_unread_s=0.2)
    started_s = time.monotonic()
    with pytest.raises(ClientNotReading) as info:  # raised at the next take, after 1 s
        asyncio.run(push_then_take(bounds, num_outputs=10_000, push_interval_s=0.01, take_interval_s=1.0))
    assert time.monotonic() - started_s < 30  # 1 s, on however loaded a machine
    assert info.value.bound == "time"
    assert re.fullmatch(r"client is not reading: output unread for 0\.2 s \(the limit\), \d+ tokens unsent",
                        info.value.message), info.value.message
    assert CLIENTS_NOT_READING.labels(bound="time")._value.get() == before + 1


def test_output_taken_within_the_time_bound_is_never_aborted():
    bounds = SlowReaderBounds(max_unsent_tokens=0, max_unread_s=5.0)
    forgotten, taken = asyncio.run(push_then_take(bounds, num_outputs=30, push_interval_s=0.001, take_interval_s=0.05))
    assert taken == list(range(30))
    assert forgotten == []


def test_a_bound_of_zero_is_off_and_a_negative_one_refused():
    assert SlowReaderBounds(max_unsent_tokens=0, max_unread_s=0)
    with pytest.raises(ValueError, match="max_unread_s"):
        SlowReaderBounds(max_unread_s=-1)


GATEWAY_REQUIRED_ARGS = ["--preprocess", "h:1", "--inference", "h:2", "--model", "m"]


def test_the_gateway_defaults_are_the_documented_ones():
    args = build_parser().parse_args(GATEWAY_REQUIRED_ARGS)
    assert (args.max_unsent_tokens, args.max_unread_s) == (DEFAULT_MAX_UNSENT_TOKENS, DEFAULT_MAX_UNREAD_S) == (2048, 20.0)


def test_llmserve_serve_passes_the_bounds_on_to_the_gateway():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = serve_config_from_args(parser.parse_args(["--max-unsent-tokens", "100", "--max-unread-s", "5"]))
    gateway_args = build_parser().parse_args([*GATEWAY_REQUIRED_ARGS, *slow_reader_argv(config.slow_readers)])
    assert slow_reader_bounds(gateway_args) == SlowReaderBounds(max_unsent_tokens=100, max_unread_s=5.0)


# --- the real stack ------------------------------------------------------------------------------

MAX_UNREAD_S = 2
# Generous for a loaded 2-core machine: the bound is seconds, what comes on top is the window
# filling and the replica's next step.
ABORT_WITHIN_S = 60.0


# Only the time bound: it must fire although no number of tokens would.
stack = stack_fixture(
    model="long_context_model_dir", gateway_args=["--max-unread-s", str(MAX_UNREAD_S), "--max-unsent-tokens", "0"]
)
default_stack = stack_fixture(model="long_context_model_dir")


def wait_until_freed(inference, num_aborted_before: int, within_s: float) -> inference_pb2.GetLoadResponse:
    """The replica's load once it aborted one more request and holds no KV block."""
    deadline = time.monotonic() + within_s
    while True:
        load = inference.GetLoad(inference_pb2.GetLoadRequest())
        if load.num_aborted_total == num_aborted_before + 1 and load.num_running == 0 and load.kv_blocks_used == 0:
            return load
        if time.monotonic() > deadline:
            pytest.fail(f"the replica did not abort the request and free its KV within {within_s} s; last: {load}")
        time.sleep(0.1)


def never_read(services) -> tuple[float, grpc.RpcError]:
    """A stream whose client never reads: seconds until its replica freed it, then the status the
    client gets once it does read."""
    inference = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(services["inference"].address))
    num_aborted_before = inference.GetLoad(inference_pb2.GetLoadRequest()).num_aborted_total
    channel = grpc.insecure_channel(services["gateway"].address, options=SMALL_WINDOW)
    started_s = time.monotonic()
    stream = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(
        gateway_pb2.GenerateStreamRequest(params=params(max_tokens=MAX_TOKENS))
    )
    stream.initial_metadata()
    load = wait_until_freed(inference, num_aborted_before, ABORT_WITHIN_S)
    freed_after_s = time.monotonic() - started_s
    assert load.num_waiting == 0
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:  # what the window held, then the status
            pass
    channel.close()
    return freed_after_s, info.value


def assert_serves(services) -> None:
    gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(services["gateway"].address))
    response = gateway.Generate(gateway_pb2.GenerateRequest(params=params(max_tokens=8)), timeout=60)
    assert response.result.usage.completion_tokens == 8


def test_a_client_that_never_reads_is_aborted_by_the_time_bound_and_its_kv_freed(stack):
    freed_after_s, error = never_read(stack)
    assert freed_after_s >= MAX_UNREAD_S
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert re.fullmatch(rf"client is not reading: output unread for {MAX_UNREAD_S} s \(the limit\), \d+ tokens unsent",
                        error.details()), error.details()
    assert_serves(stack)


def test_a_client_that_reads_slowly_is_not_aborted(default_stack):
    # What the time bound measures is how long the client's window stays full: its backlog (what
    # the window holds, ~20 one-token messages here) times its read interval (grpc's client makes
    # room only once it has read what it holds). ~10 s of backlog: inside the default 20 s.
    channel = grpc.insecure_channel(default_stack["gateway"].address, options=SMALL_WINDOW)
    stream = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(
        gateway_pb2.GenerateStreamRequest(params=params(max_tokens=200))
    )
    messages = []
    for message in stream:  # one message per 0.5 s: each takes everything made since the last
        messages.append(message)
        time.sleep(0.5)
    assert sum(len(m.token_ids) for m in messages) == 200
    assert messages[-1].result.usage.completion_tokens == 200
    channel.close()


def test_with_the_defaults_a_client_that_never_reads_is_aborted_once_its_window_is_full(default_stack):
    freed_after_s, error = never_read(default_stack)
    # The tokens bound if the replica makes 2048 tokens before 20 s pass, else the time bound.
    assert freed_after_s < DEFAULT_MAX_UNREAD_S + ABORT_WITHIN_S
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert error.details().startswith("client is not reading: "), error.details()
    assert_serves(default_stack)

"""The bounded, coalescing client stream (gateway.client_stream).

In process: what a slow writer receives from a fast pipeline (merged deltas, the bound, errors,
closing). On the real stack (torch backend, tiny model with a long context): a stream still says
what Generate says, and a client that stops reading has its request aborted and its KV freed.
"""

from __future__ import annotations

import asyncio
import re
import time
from contextlib import aclosing
from pathlib import Path

import grpc
import pytest

from llmserve.errors import ServiceError
from llmserve.gateway.client_stream import ClientNotReading, coalesced, merge_deltas
from llmserve.gateway.generation import GenerationDelta, GenerationResult
from llmserve.sampling import FinishReason, TokenLogprob
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.factories import with_context
from tests.procs import stack_fixture

RESULT = GenerationResult(
    finish_reason=FinishReason.LENGTH, matched_stop=None, num_prompt_tokens=3, num_completion_tokens=4,
    num_cached_tokens=0, queue_time_ns=1, preprocess_time_ns=1, time_to_first_token_ns=2, total_time_ns=3,
    replica_id="r0", predicted_cached_tokens=0,
)


def token_delta(token_id: int, *, result: GenerationResult | None = None) -> GenerationDelta:
    return GenerationDelta(text=f"<{token_id}>", token_ids=[token_id], logprobs=None, result=result)


class Pipeline:
    """A pipeline's deltas, produced as fast as the loop runs; records whether it was closed."""

    def __init__(self, deltas: list[GenerationDelta], error: Exception | None = None):
        self.deltas = deltas
        self.error = error
        self.is_closed = False
        self.num_yielded = 0

    async def generate(self):
        try:
            for delta in self.deltas:
                yield delta
                self.num_yielded += 1
                await asyncio.sleep(0)
            if self.error is not None:
                raise self.error
        finally:
            self.is_closed = True


async def take_all(pipeline: Pipeline, max_unsent_tokens: int, *, write_delay_s: float = 0.0):
    """What a writer that takes `write_delay_s` per message receives."""
    received = []
    async with aclosing(coalesced(pipeline.generate(), "r1", max_unsent_tokens)) as deltas:
        async for delta in deltas:
            received.append(delta)
            await asyncio.sleep(write_delay_s)
    return received


def test_merge_concatenates_text_tokens_and_logprobs_and_keeps_the_last_result():
    first = GenerationDelta(text="a", token_ids=[1], logprobs=[TokenLogprob(token_id=1, logprob=-0.5)])
    held_back = GenerationDelta(text="", token_ids=[2], logprobs=[TokenLogprob(token_id=2, logprob=-1.0)])
    last = GenerationDelta(text="bc", token_ids=[3], logprobs=[TokenLogprob(token_id=3, logprob=-2.0)], result=RESULT)
    merged = merge_deltas([first, held_back, last])
    assert merged.text == "abc"
    assert merged.token_ids == [1, 2, 3]
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3]
    assert merged.result is RESULT
    assert merge_deltas([token_delta(1), token_delta(2)]).logprobs is None


def test_a_writer_that_keeps_up_gets_one_token_per_message():
    deltas = [token_delta(i) for i in range(5)] + [token_delta(5, result=RESULT)]
    received = asyncio.run(take_all(Pipeline(deltas), max_unsent_tokens=0))
    assert [d.token_ids for d in received] == [[i] for i in range(6)]
    assert received[-1].result is RESULT


def test_a_slow_writer_gets_fewer_larger_messages_with_everything_in_order():
    deltas = [token_delta(i) for i in range(99)] + [token_delta(99, result=RESULT)]
    received = asyncio.run(take_all(Pipeline(deltas), max_unsent_tokens=0, write_delay_s=0.01))
    assert 1 < len(received) < 100
    assert [t for d in received for t in d.token_ids] == list(range(100))
    assert "".join(d.text for d in received) == "".join(f"<{i}>" for i in range(100))
    assert [d.result for d in received] == [None] * (len(received) - 1) + [RESULT]


def test_more_unsent_tokens_than_the_bound_closes_the_pipeline_and_raises():
    pipeline = Pipeline([token_delta(i) for i in range(1000)])
    with pytest.raises(ClientNotReading) as info:
        asyncio.run(take_all(pipeline, max_unsent_tokens=10, write_delay_s=1.0))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.message == "client is not reading: 11 tokens unsent (limit 10)"
    assert pipeline.is_closed
    assert pipeline.num_yielded < 20  # reading stopped at the bound, not at the end


def test_a_pipeline_error_reaches_the_writer():
    pipeline = Pipeline([token_delta(0)], error=ServiceError("inference failed"))
    with pytest.raises(ServiceError, match="inference failed"):
        asyncio.run(take_all(pipeline, max_unsent_tokens=0))


def test_closing_the_stream_closes_the_pipeline():
    async def read_one_then_close(pipeline: Pipeline) -> None:
        async with aclosing(coalesced(pipeline.generate(), "r1", 0)) as deltas:
            await anext(deltas)

    pipeline = Pipeline([token_delta(i) for i in range(1000)])
    asyncio.run(read_one_then_close(pipeline))
    assert pipeline.is_closed
    assert pipeline.num_yielded < 1000


# --- the real stack ------------------------------------------------------------------------------

CONTEXT_TOKENS = 4096
MAX_TOKENS = 4000  # with ignore_eos: far more than a small window and the bound hold
MAX_UNSENT_TOKENS = 8
# A client whose HTTP/2 receive window stays ~1 KiB (no BDP growth), so that the gateway's writes
# block after a few messages when it does not read (grpc's default window grows to ~1 MiB).
SMALL_WINDOW = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))
WAIT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def long_context_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return with_context(tiny_model_dir, tmp_path_factory.mktemp("tiny-llama-long"), CONTEXT_TOKENS)


stack = stack_fixture(model="long_context_model_dir", gateway_args=["--max-unsent-tokens", str(MAX_UNSENT_TOKENS)])


def params(max_tokens: int) -> gateway_pb2.GenerateParams:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return gateway_pb2.GenerateParams(prompt="Hello there", sampling=sampling, return_token_ids=True)


def wait_for_load(inference, predicate) -> inference_pb2.GetLoadResponse:
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while not predicate(load := inference.GetLoad(inference_pb2.GetLoadRequest())):
        if time.monotonic() > deadline:
            pytest.fail(f"inference load never satisfied the condition; last: {load}")
        time.sleep(0.05)
    return load


def test_stream_says_what_generate_says(stack):
    gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack["gateway"].address))
    request = params(max_tokens=48)
    unary = gateway.Generate(gateway_pb2.GenerateRequest(params=request))
    messages = list(gateway.GenerateStream(gateway_pb2.GenerateStreamRequest(params=request)))
    assert "".join(m.text for m in messages) == unary.text
    assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
    assert messages[-1].result.usage.completion_tokens == unary.result.usage.completion_tokens == 48
    assert all(not m.HasField("result") for m in messages[:-1])


def test_a_client_that_stops_reading_is_aborted_within_the_bound(stack):
    inference = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(stack["inference"].address))
    before = inference.GetLoad(inference_pb2.GetLoadRequest())
    channel = grpc.insecure_channel(stack["gateway"].address, options=SMALL_WINDOW)
    stream = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(
        gateway_pb2.GenerateStreamRequest(params=params(max_tokens=MAX_TOKENS))
    )
    num_received_tokens = len(next(stream).token_ids)

    load = wait_for_load(inference, lambda load: load.num_aborted_total == before.num_aborted_total + 1)
    load = wait_for_load(inference, lambda load: load.num_running == 0 and load.kv_blocks_used == 0)
    assert load.num_waiting == 0

    with pytest.raises(grpc.RpcError) as info:
        for message in stream:  # what the window held, then the status
            num_received_tokens += len(message.token_ids)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    unsent = re.fullmatch(rf"client is not reading: (\d+) tokens unsent \(limit {MAX_UNSENT_TOKENS}\)",
                          info.value.details())
    assert unsent is not None, info.value.details()
    assert int(unsent.group(1)) > MAX_UNSENT_TOKENS
    assert num_received_tokens + int(unsent.group(1)) < MAX_TOKENS
    channel.close()

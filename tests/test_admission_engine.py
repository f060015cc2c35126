"""Admission in AsyncEngine over a real TorchEngineCore (tiny checkpoint), and in the inference
service over real gRPC: refusals carry their status and retry hint, and hold nothing."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import grpc
import pytest

from llmserve.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from llmserve.inference.admission import DEFAULT_RETRY_AFTER_MS, MAX_RETRY_AFTER_MS, MIN_RETRY_AFTER_MS, AdmissionConfig
from llmserve.inference.drain_meter import MIN_SAMPLE_S
from llmserve.inference.engine.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import FinishReason, SamplingParams
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.procs import running_service
from tests.rich_status import retry_delay_ms

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [5, 17, 42, 99, 100, 7, 250, 31]
NUM_KV_BLOCKS = 20  # 320 tokens: one request of 8 + 200 tokens (13 blocks) fits, two do not
LONG_MAX_TOKENS = 200
HANG_GUARD_S = 60.0


def make_request(request_id: str, max_tokens: int = LONG_MAX_TOKENS, deadline_ns: int = 0) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id, list(PROMPT), sampling, time.monotonic_ns(), deadline_ns=deadline_ns)


@pytest.fixture
async def engine(tiny_model_dir):
    config = EngineConfig(model_path=tiny_model_dir, model_name="tiny", num_kv_blocks=NUM_KV_BLOCKS)
    engine = AsyncEngine(EngineThread(TorchEngineCore(config)), admission=AdmissionConfig.of(config))
    await engine.start()
    yield engine
    await engine.shutdown(drain_timeout_s=0.0)


async def first_output(engine: AsyncEngine, request: EngineRequest):
    return await engine.generate(request).__anext__()


async def run_to_end(engine: AsyncEngine, request: EngineRequest) -> list:
    async def consume():
        return [output async for output in engine.generate(request)]

    return await asyncio.wait_for(consume(), HANG_GUARD_S)


async def wait_until_pool_is_free(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while engine.load().kv_blocks_used:
        assert time.monotonic() < deadline, "KV blocks still held"
        await asyncio.sleep(0.01)


async def test_over_the_kv_budget_is_resource_exhausted_with_a_retry_hint_and_holds_nothing(engine):
    async with aclosing(engine.generate(make_request("running"))) as running:
        await asyncio.wait_for(running.__anext__(), HANG_GUARD_S)  # holds blocks now
        used_blocks = engine.load().kv_blocks_used
        with pytest.raises(ResourceExhausted) as refused:
            await first_output(engine, make_request("refused"))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV blocks" in refused.value.message and f"over the {NUM_KV_BLOCKS}" in refused.value.message
        assert refused.value.retry_after_ms == DEFAULT_RETRY_AFTER_MS  # nothing has finished yet
        assert engine.load().kv_blocks_used <= used_blocks + 1  # the running one's next block at most
        outputs = [output async for output in running]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    await wait_until_pool_is_free(engine)
    # The refused request left nothing behind: its id is free and the pool is whole.
    outputs = await run_to_end(engine, make_request("refused"))
    assert sum(len(output.new_token_ids) for output in outputs) == LONG_MAX_TOKENS
    await wait_until_pool_is_free(engine)


async def test_the_retry_hint_follows_the_measured_drain(engine):
    await run_to_end(engine, make_request("measure"))  # its blocks are released: a KV drain rate
    async with aclosing(engine.generate(make_request("running"))) as running:
        started = time.monotonic()
        async for _ in running:  # a sample spans at least drain_meter.MIN_SAMPLE_S in flight
            if time.monotonic() - started > MIN_SAMPLE_S:
                break
        with pytest.raises(ResourceExhausted) as refused:
            await first_output(engine, make_request("refused"))
    assert MIN_RETRY_AFTER_MS <= refused.value.retry_after_ms <= MAX_RETRY_AFTER_MS
    assert refused.value.retry_after_ms != DEFAULT_RETRY_AFTER_MS
    await wait_until_pool_is_free(engine)


async def test_a_request_larger_than_the_whole_pool_is_invalid(engine):
    request = make_request("huge")
    request.sampling = SamplingParams(max_tokens=LONG_MAX_TOKENS, n=2)  # 2 x 13 blocks
    with pytest.raises(InvalidArgument) as refused:
        await first_output(engine, request)
    assert refused.value.field == "sampling.max_tokens"
    assert engine.load().kv_blocks_used == 0


async def test_a_deadline_the_measured_pace_cannot_meet_is_refused_before_queueing(engine):
    deadline_ns = time.monotonic_ns() + 10**9  # 1 s: ample on a cold replica, which admits it
    outputs = await run_to_end(engine, make_request("cold", max_tokens=40, deadline_ns=deadline_ns))
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    # Now a step time is measured: 200 tokens cannot finish in 1 ms.
    with pytest.raises(DeadlineExceeded) as refused:
        await first_output(engine, make_request("tight", deadline_ns=time.monotonic_ns() + 10**6))
    assert refused.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and "estimated" in refused.value.message
    with pytest.raises(DeadlineExceeded, match="passed"):
        await first_output(engine, make_request("late", deadline_ns=time.monotonic_ns() - 1))
    await wait_until_pool_is_free(engine)
    assert engine.load().num_waiting == 0 and engine.load().num_running == 0


async def test_the_inference_service_answers_resource_exhausted_with_retry_info(tiny_model_dir, tmp_path):
    args = ["--model", str(tiny_model_dir), "--num-kv-blocks", str(NUM_KV_BLOCKS)]
    sampling = common_pb2.SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with running_service("inference", args, tmp_path) as service:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)

            def generate(request_id: str):
                request = inference_pb2.GenerateTokensRequest(
                    request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling
                )
                return stub.GenerateTokens(request, timeout=HANG_GUARD_S)

            running = generate("running")
            await running.read()
            refused = generate("refused")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await refused.read()
            running.cancel()
            load = await stub.GetLoad(inference_pb2.GetLoadRequest())
    assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV blocks" in error.value.details()
    assert retry_delay_ms(error.value) == DEFAULT_RETRY_AFTER_MS
    assert load.kv_blocks_total == NUM_KV_BLOCKS

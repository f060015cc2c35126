"""Admission in AsyncEngine over a real TorchEngineCore (tiny checkpoint), and in the inference
service over real gRPC: refusals carry their status and retry hint, and hold nothing."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import grpc
import pytest

from llmserve.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from llmserve.inference.admission import (
    DEFAULT_RETRY_AFTER_MS,
    MAX_RETRY_AFTER_MS,
    MIN_RETRY_AFTER_MS,
    SPREAD_HIGH,
    SPREAD_LOW,
    AdmissionConfig,
)
from llmserve.inference.drain_meter import MIN_SAMPLE_S
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import FinishReason, SamplingParams
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests import engine_objects
from tests.engine_objects import PROMPT
from tests.engine_streams import generate
from tests.procs import running_service
from tests.rich_status import retry_delay_ms

pytestmark = pytest.mark.asyncio(loop_scope="session")

NUM_KV_BLOCKS = 20  # 320 tokens: one request of 8 + 200 tokens (13 blocks) fits, two do not
LONG_MAX_TOKENS = 200
HANG_GUARD_S = 60.0
LEAK_GUARD_S = 5.0


def is_spread_default(retry_after_ms: int) -> bool:
    """The hint before any drain is measured, spread as every hint is (admission.jittered)."""
    return int(SPREAD_LOW * DEFAULT_RETRY_AFTER_MS) <= retry_after_ms <= int(SPREAD_HIGH * DEFAULT_RETRY_AFTER_MS)


make_request = functools.partial(engine_objects.make_request, max_tokens=LONG_MAX_TOKENS, temperature=0.0, ignore_eos=True)


@asynccontextmanager
async def started_engine(model_dir, num_kv_blocks: int, **options) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(model_path=model_dir, model_name="tiny", num_kv_blocks=num_kv_blocks, **options)
    engine = AsyncEngine(EngineThread(TorchEngineCore(config)), admission=AdmissionConfig.of(config))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown(drain_timeout_s=0.0)


@pytest.fixture
async def engine(tiny_model_dir):
    async with started_engine(tiny_model_dir, NUM_KV_BLOCKS) as engine:
        yield engine


async def first_output(engine: AsyncEngine, request: EngineRequest):
    return await generate(engine, request).__anext__()


async def run_to_end(engine: AsyncEngine, request: EngineRequest) -> list:
    async def consume():
        return [output async for output in generate(engine, request)]

    return await asyncio.wait_for(consume(), HANG_GUARD_S)


async def wait_until_pool_is_free(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while engine.load().kv_blocks_used:
        assert time.monotonic() < deadline, "KV blocks still held"
        await asyncio.sleep(0.01)


async def test_over_the_kv_budget_is_resource_exhausted_with_a_retry_hint_and_holds_nothing(engine):
    async with aclosing(generate(engine, make_request("running"))) as running:
        await asyncio.wait_for(running.__anext__(), HANG_GUARD_S)  # holds blocks now
        used_blocks = engine.load().kv_blocks_used
        with pytest.raises(ResourceExhausted) as refused:
            await first_output(engine, make_request("refused"))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV blocks" in refused.value.message and f"over the {NUM_KV_BLOCKS}" in refused.value.message
        assert is_spread_default(refused.value.retry_after_ms)  # nothing has finished yet
        assert engine.load().kv_blocks_used <= used_blocks + 1  # the running one's next block at most
        outputs = [output async for output in running]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    await wait_until_pool_is_free(engine)
    # The refused request left nothing behind: its id is free and the pool is whole.
    outputs = await run_to_end(engine, make_request("refused"))
    assert sum(len(output.new_token_ids) for output in outputs) == LONG_MAX_TOKENS
    await wait_until_pool_is_free(engine)


async def test_the_retry_hint_follows_the_measured_drain(engine):
    # A drain sample spans at least drain_meter.MIN_SAMPLE_S with blocks in flight, summed over
    # requests: run whole requests until that much has passed, however fast this machine is (a
    # request kept running for it would end first on a fast one).
    in_flight_s, num_measured = 0.0, 0
    while in_flight_s <= 2 * MIN_SAMPLE_S:
        started = time.monotonic()
        await run_to_end(engine, make_request(f"measure-{num_measured}"))  # its blocks released: drained
        in_flight_s += time.monotonic() - started
        num_measured += 1
    async with aclosing(generate(engine, make_request("running"))) as running:
        await asyncio.wait_for(running.__anext__(), HANG_GUARD_S)  # holds its blocks now
        with pytest.raises(ResourceExhausted) as refused:
            await first_output(engine, make_request("refused"))
    # its exact value (the excess over the measured drain, spread) is test_admission's
    assert MIN_RETRY_AFTER_MS <= refused.value.retry_after_ms <= MAX_RETRY_AFTER_MS
    await wait_until_pool_is_free(engine)


async def test_a_request_larger_than_the_whole_pool_is_invalid(engine):
    request = make_request("huge")
    request.sampling = SamplingParams(max_tokens=LONG_MAX_TOKENS, n=2)  # 2 x 13 blocks
    with pytest.raises(InvalidArgument) as refused:
        await first_output(engine, request)
    assert refused.value.field == "sampling.max_tokens"
    assert engine.load().kv_blocks_used == 0


async def test_a_deadline_the_measured_pace_cannot_meet_is_refused_before_queueing(engine):
    deadline_ns = time.monotonic_ns() + 10 * 10**9  # ample even on a loaded CPU; a cold replica admits it
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
    assert is_spread_default(retry_delay_ms(error.value))
    assert load.kv_blocks_total == NUM_KV_BLOCKS


# --- shared prefixes -----------------------------------------------------------------------------

SYSTEM_PROMPT = [3 + (index * 37) % 300 for index in range(128)]  # 8 blocks
NUM_SHARERS = 4
SHARER_MAX_TOKENS = 24  # a sharer of 128 + 8 tokens holds 10 blocks at full length, 2 of its own
LONG_SHARER_MAX_TOKENS = 120  # 16 blocks, 8 of its own: it outlives the others
PREFIX_ONCE_AND_TAILS = 8 + 8 + (NUM_SHARERS - 1) * 2
DISTINCT_MAX_TOKENS = 152  # 8 + 152 tokens of a prompt of its own: 10 blocks, none shared


def shared_prefix_request(request_id: str, own_token_id: int, max_tokens: int = SHARER_MAX_TOKENS) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id, SYSTEM_PROMPT + [own_token_id] * 8, sampling, time.monotonic_ns())


async def assert_nothing_is_held(engine: AsyncEngine) -> None:
    """The pool is free, and so is admission's whole KV budget: a request of the whole pool at
    its full length is admitted (once the last final outputs, delivered after the core let go of
    their blocks, have reached admission)."""
    await wait_until_pool_is_free(engine)
    num_tokens = engine.load().kv_blocks_total * 16
    whole = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    deadline = time.monotonic() + LEAK_GUARD_S
    while True:
        try:
            await run_to_end(engine, EngineRequest("whole", [9] * (num_tokens - 8), whole, time.monotonic_ns()))
            break
        except ResourceExhausted:
            assert time.monotonic() < deadline, "admission still charges blocks nobody holds"
            await asyncio.sleep(0.05)
    await wait_until_pool_is_free(engine)


async def test_requests_sharing_a_prefix_fit_a_pool_of_the_prefix_once_and_their_tails(tiny_model_dir):
    async with started_engine(tiny_model_dir, PREFIX_ONCE_AND_TAILS) as engine:
        first = generate(engine, shared_prefix_request("first", 400, max_tokens=LONG_SHARER_MAX_TOKENS))
        await asyncio.wait_for(first.__anext__(), HANG_GUARD_S)  # started: the prefix is computed
        with pytest.raises(ResourceExhausted):  # 16 + 10 blocks
            await first_output(engine, make_request("distinct", max_tokens=DISTINCT_MAX_TOKENS))
        others = [shared_prefix_request(f"sharer-{index}", 401 + index) for index in range(NUM_SHARERS - 1)]
        results = await asyncio.gather(_drain(first), *(run_to_end(engine, request) for request in others))
        for outputs in results:
            assert outputs[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(output.new_token_ids) for output in results[1]) == SHARER_MAX_TOKENS
        assert results[1][-1].num_cached_tokens == len(SYSTEM_PROMPT)
        assert engine.load().num_preemptions_total == 0
        await assert_nothing_is_held(engine)


async def test_the_prefix_stays_charged_until_its_last_holder_ends(tiny_model_dir):
    # the long sharer's 8 + 8 blocks, and 2 more for two short ones (136 + 8 tokens: 1 of their own)
    async with started_engine(tiny_model_dir, 8 + 8 + 2) as engine:
        with pytest.raises(DeadlineExceeded):
            late = shared_prefix_request("late", 399)
            late.deadline_ns = time.monotonic_ns() - 1
            await first_output(engine, late)
        first = generate(engine, shared_prefix_request("first", 400, max_tokens=8))
        await asyncio.wait_for(first.__anext__(), HANG_GUARD_S)  # charged the prefix, and started
        last = generate(engine, shared_prefix_request("last", 401, max_tokens=LONG_SHARER_MAX_TOKENS))
        await asyncio.wait_for(last.__anext__(), HANG_GUARD_S)
        cancelled = generate(engine, shared_prefix_request("cancelled", 402, max_tokens=8))
        await asyncio.wait_for(cancelled.__anext__(), HANG_GUARD_S)
        await cancelled.aclose()  # aborts it
        await asyncio.wait_for(_drain(first), HANG_GUARD_S)
        while engine.load().num_running > 1:
            await asyncio.sleep(0.01)
        # only `last` runs: its 8 blocks and 10 would fit the 18, not with its prefix's 8 too
        with pytest.raises(ResourceExhausted):
            await first_output(engine, make_request("distinct", max_tokens=DISTINCT_MAX_TOKENS))
        rest = await asyncio.wait_for(_drain(last), HANG_GUARD_S)
        assert rest[-1].finish_reason is FinishReason.LENGTH
        assert engine.load().num_preemptions_total == 0
        await assert_nothing_is_held(engine)


async def _drain(outputs: AsyncIterator) -> list:
    return [output async for output in outputs]


async def test_a_sharer_that_could_compute_the_prefix_twice_waits_for_room(tiny_model_dir):
    # 64 tokens a step: the holder computes its 120 tokens in two chunks; a sharer arriving with
    # it would compute the second chunk's shared blocks again (its own 23 tokens after 112
    # shared), 4 blocks at once: on a pool of 10, where the two fit at full length but not those
    # 4 more, it is refused until the holder has started instead of being preempted.
    prompt = [3 + (index * 7) % 290 for index in range(120)]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    holder = EngineRequest("holder", prompt, SamplingParams(max_tokens=8, **greedy), time.monotonic_ns())
    sharer = EngineRequest("sharer", prompt[:112] + [5] * 23, SamplingParams(max_tokens=1, **greedy), time.monotonic_ns())

    async def retried(engine: AsyncEngine, request: EngineRequest) -> list:
        while True:
            try:
                return await run_to_end(engine, request)
            except ResourceExhausted:
                await asyncio.sleep(0.01)

    async with started_engine(tiny_model_dir, 10, max_batched_tokens=64) as engine:
        outputs = await asyncio.gather(run_to_end(engine, holder), retried(engine, sharer))
        assert [output[-1].finish_reason for output in outputs] == [FinishReason.LENGTH] * 2
        assert engine.load().num_preemptions_total == 0


async def test_random_shared_prefix_traffic_on_a_small_pool_is_never_preempted(tiny_model_dir):
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 300) for _ in range(length)] for length in (40, 72, 120)]
    # Drawn up front, so the traffic is the same however the run interleaves: 40 requests in
    # bursts, each sharing one of the prefixes.
    bursts: dict[int, list[tuple[list[int], SamplingParams]]] = {}
    for _ in range(40):
        burst = rng.randrange(4)
        prompt = rng.choice(prefixes) + [rng.randrange(3, 300) for _ in range(rng.randrange(0, 20))]
        sampling = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.0, ignore_eos=True, n=rng.choice([1, 2]))
        bursts.setdefault(burst, []).append((prompt, sampling))
    outcomes = {"done": 0, "refused": 0}

    async def one(request_id: str, prompt: list[int], sampling: SamplingParams, engine: AsyncEngine) -> None:
        try:
            await run_to_end(engine, EngineRequest(request_id, prompt, sampling, time.monotonic_ns()))
            outcomes["done"] += 1
        except ResourceExhausted:
            outcomes["refused"] += 1

    # 32 tokens a step: long prompts are computed in chunks, by several sharers at once
    async with started_engine(tiny_model_dir, 24, max_batched_tokens=32) as engine:
        for burst, requests in sorted(bursts.items()):
            # A burst arrives at once (its requests are admitted or refused in one turn of the
            # event loop, where admission runs), on a pool its previous burst has freed: what is
            # refused depends on the traffic, not on how fast this machine computes.
            await wait_until_pool_is_free(engine)
            await asyncio.gather(*(one(f"b{burst}-r{i}", *request, engine) for i, request in enumerate(requests)))
        assert engine.load().num_preemptions_total == 0
        assert outcomes["done"] >= 10 and outcomes["refused"] >= 5
        await assert_nothing_is_held(engine)

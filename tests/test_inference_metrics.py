"""The inference replica's /metrics (docs/observability.md, llmserve_inference_*) after real
requests: the real service (torch backend, tiny checkpoint, engine core in its own process)
scraped over HTTP, each metric moved by exactly what the requests did."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import SamplingParams
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.engine_streams import generate as engine_outputs
from tests.metrics_scrape import Scrape, scrape
from tests.procs import free_port, running_service

pytestmark = pytest.mark.asyncio(loop_scope="session")

HANG_GUARD_S = 60.0
BLOCK = 16
NUM_KV_BLOCKS = 8  # 128 tokens
SHARED = list(range(10, 10 + 2 * BLOCK))  # two full blocks
FIRST = SHARED + list(range(100, 108))
SECOND = SHARED + list(range(120, 128))  # finds FIRST's two blocks in the prefix cache
SHORT_SAMPLING = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG_PROMPT = [5, 17, 42, 99, 100, 7, 250, 31]
# 8 + 112 tokens: the whole pool at full length. With --kv-overcommit 2 two of them are admitted
# and, run together, cannot both fit (one is preempted); a third is over the KV budget.
LONG_SAMPLING = common_pb2.SamplingParams(max_tokens=112, temperature=0.0, ignore_eos=True)
STEP = "llmserve_inference_step_duration_seconds"
BATCH = "llmserve_inference_batch_size"


def generate(stub, request_id: str, prompt: list[int], sampling: common_pb2.SamplingParams):
    request = inference_pb2.GenerateTokensRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
    return stub.GenerateTokens(request)


async def usage_of(call) -> common_pb2.Usage:
    """Read the stream to its end: the usage of its one sequence."""

    async def last():
        last_response = None
        while (response := await call.read()) is not grpc.aio.EOF:
            last_response = response
        return last_response

    return (await asyncio.wait_for(last(), HANG_GUARD_S)).usage


async def wait_until_idle(stub) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        load = await stub.GetLoad(inference_pb2.GetLoadRequest())
        if load.num_running == 0 and load.num_waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the replica did not go idle")


def steps_of(end: Scrape, start: Scrape) -> tuple[float, float]:
    """(steps, sequences over those steps) between two scrapes."""
    num_steps = end.delta(start, f"{STEP}_count")
    assert end.delta(start, f"{BATCH}_count") == num_steps
    return num_steps, end.delta(start, f"{BATCH}_sum")


async def test_inference_metrics_follow_the_requests(tiny_model_dir, tmp_path):
    port = free_port()
    args = [
        "--model", str(tiny_model_dir), "--num-kv-blocks", str(NUM_KV_BLOCKS), "--kv-overcommit", "2",
        "--metrics-port", str(port),
    ]  # fmt: skip
    with running_service("inference", args, tmp_path) as service:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            start = scrape(port)
            usages = [await usage_of(generate(stub, "first", FIRST, SHORT_SAMPLING))]
            usages.append(await usage_of(generate(stub, "second", SECOND, SHORT_SAMPLING)))
            after_prefix = scrape(port)

            long_calls = [generate(stub, "long-1", LONG_PROMPT, LONG_SAMPLING)]
            await long_calls[0].read()
            during = scrape(port)
            long_calls.append(generate(stub, "long-2", LONG_PROMPT, LONG_SAMPLING))
            await long_calls[1].read()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(stub, "refused", LONG_PROMPT, LONG_SAMPLING).read()
            long_usages = [await usage_of(call) for call in long_calls]
            await wait_until_idle(stub)
            end = scrape(port)

    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert start.types[BATCH] == "histogram" and start.types["llmserve_inference_kv_blocks_used"] == "gauge"
    assert start.types["llmserve_inference_preemptions"] == "counter"

    # Two requests one after the other, the second finding the first's two full blocks.
    assert after_prefix.delta(start, "llmserve_inference_prefix_cache_queried_tokens_total") == len(FIRST) + len(SECOND)
    assert after_prefix.delta(start, "llmserve_inference_prefix_cache_hit_tokens_total") == 2 * BLOCK
    assert sum(usage.cached_tokens for usage in usages) == 2 * BLOCK
    assert after_prefix.delta(start, "llmserve_inference_prompt_tokens_total") == len(FIRST) + len(SECOND)
    assert after_prefix.delta(start, "llmserve_inference_generation_tokens_total") == sum(
        usage.completion_tokens for usage in usages
    ) == 2 * SHORT_SAMPLING.max_tokens
    num_steps, num_seqs = steps_of(after_prefix, start)
    assert num_steps >= 2 * SHORT_SAMPLING.max_tokens and num_seqs == num_steps  # one sequence at a time
    assert after_prefix.delta(start, f"{STEP}_sum") > 0
    assert after_prefix.delta(start, "llmserve_inference_prompts_received_total", encoding="token_ids") == 2
    assert after_prefix.delta(start, "llmserve_inference_prompts_received_total", encoding="token_id_bytes") == 0

    # One long request running: the gauges read the engine's load at scrape time.
    assert during.value("llmserve_inference_requests_running") == 1
    assert during.value("llmserve_inference_kv_blocks_used") >= 1
    assert during.value("llmserve_inference_kv_blocks_total") == NUM_KV_BLOCKS

    # Two long requests together, a third refused.
    assert end.delta(after_prefix, "llmserve_inference_admissions_refused_total", reason="RESOURCE_EXHAUSTED") == 1
    assert end.delta(after_prefix, "llmserve_inference_admissions_refused_total", reason="DEADLINE_EXCEEDED") == 0
    assert end.delta(after_prefix, "llmserve_inference_preemptions_total") >= 1
    # A prompt counts once, when its request produced its first token, preempted later or not.
    assert end.delta(after_prefix, "llmserve_inference_prompt_tokens_total") == 2 * len(LONG_PROMPT)
    assert end.delta(after_prefix, "llmserve_inference_generation_tokens_total") == sum(
        usage.completion_tokens for usage in long_usages
    ) == 2 * LONG_SAMPLING.max_tokens
    num_steps, num_seqs = steps_of(end, after_prefix)
    assert num_steps < num_seqs < 2 * num_steps  # some steps ran both, not all
    for gauge in ("requests_running", "requests_waiting", "kv_blocks_used"):
        assert end.value(f"llmserve_inference_{gauge}") == 0


async def test_the_hf_backend_reports_steps_and_tokens_and_no_kv_pool(tiny_model_dir, tmp_path):
    port = free_port()
    args = ["--model", str(tiny_model_dir), "--backend", "hf", "--metrics-port", str(port)]
    with running_service("inference", args, tmp_path) as service:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            start = scrape(port)
            usage = await usage_of(generate(stub, "hf", FIRST, SHORT_SAMPLING))
            end = scrape(port)
    num_steps, num_seqs = steps_of(end, start)
    assert num_steps == num_seqs == usage.completion_tokens == SHORT_SAMPLING.max_tokens  # a token per step
    assert end.delta(start, "llmserve_inference_generation_tokens_total") == SHORT_SAMPLING.max_tokens
    assert end.delta(start, "llmserve_inference_prompt_tokens_total") == len(FIRST)
    assert end.value("llmserve_inference_kv_blocks_total") == 0
    assert end.value("llmserve_inference_prefix_cache_queried_tokens_total") == 0


async def test_an_engine_on_a_thread_reports_its_steps_too(tiny_model_dir):
    """The core on a thread of the server process (--no-core-process) hands AsyncEngine the same
    StepReports; read from this process's own default registry."""
    from prometheus_client import REGISTRY

    def count() -> float:
        return REGISTRY.get_sample_value(f"{BATCH}_count") or 0.0

    config = EngineConfig(model_path=tiny_model_dir, model_name="tiny", num_kv_blocks=NUM_KV_BLOCKS)
    engine = AsyncEngine(EngineThread(TorchEngineCore(config)))
    await engine.start()
    before = count()
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        outputs = [out async for out in engine_outputs(engine, EngineRequest("thread", FIRST, sampling, time.monotonic_ns()))]
    finally:
        await engine.shutdown(drain_timeout_s=0.0)
    assert outputs[-1].num_completion_tokens == 4
    assert count() - before >= 4

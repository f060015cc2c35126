"""AsyncEngine over a real HFEngineCore on the tiny checkpoint: streaming, aborts, failures, drain."""

from __future__ import annotations

import asyncio
import functools
import time
from contextlib import aclosing

import pytest

from llmserve.errors import InvalidArgument, Unavailable
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.hf_engine import HFEngineCore
from llmserve.engine_output import EngineOutput
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import FinishReason
from tests import engine_objects
from tests.engine_objects import PROMPT
from tests.engine_streams import HANG_GUARD_S, collect, generate, wait_until

# Async fixtures live on the session loop (pyproject); run the tests on it too.
pytestmark = pytest.mark.asyncio(loop_scope="session")


make_request = functools.partial(engine_objects.make_request, temperature=0.0)


def hf_config(model_dir) -> EngineConfig:
    return EngineConfig(model_path=model_dir, model_name="tiny", backend="hf")


async def collect_once_free(engine: AsyncEngine, request: EngineRequest) -> list[EngineOutput]:
    """collect, retried while an aborted request still holds the id: it is in flight until its
    CANCELLED output reaches the loop, shortly after the load counts the abort."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            return await collect(engine, request)
        except InvalidArgument:
            assert time.monotonic() < deadline, "the request id was never freed"
            await asyncio.sleep(0.005)


def reference_tokens(model_dir, request: EngineRequest) -> list[int]:
    core = HFEngineCore(hf_config(model_dir))
    core.add_request(request)
    outputs = []
    while core.has_requests_in_flight():
        outputs += core.step()
    return [t for o in outputs for t in o.new_token_ids]


@pytest.fixture
async def engine(tiny_model_dir):
    engine = AsyncEngine(EngineThread(HFEngineCore(hf_config(tiny_model_dir))))
    await engine.start()
    yield engine
    await engine.shutdown(drain_timeout_s=0.0)


async def test_concurrent_requests_all_complete(engine, tiny_model_dir):
    requests = [make_request(f"r{i}", PROMPT[i:], max_tokens=6 + i, ignore_eos=True) for i in range(4)]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    for request, outputs in zip(requests, results):
        assert [t for o in outputs for t in o.new_token_ids] == reference_tokens(tiny_model_dir, request)
        # a reader that falls behind gets coalesced outputs: only the last one is final
        assert [o.finish_reason for o in outputs] == [None] * (len(outputs) - 1) + [FinishReason.LENGTH]
    load = engine.load()
    assert (load.num_running, load.num_waiting, load.num_finished_total, load.num_aborted_total) == (0, 0, 4, 0)
    assert not any(engine.abort(r.request_id) for r in requests)  # none is in flight any more


async def test_n_sequences_each_end_once(engine):
    outputs = await collect(engine, make_request("n", n=2, temperature=1.0, seed=5, max_tokens=3, ignore_eos=True))
    finals = [(o.sequence_index, o.finish_reason) for o in outputs if o.is_finished]
    assert finals == [(0, FinishReason.LENGTH), (1, FinishReason.LENGTH)]


async def test_abort_mid_stream_ends_the_stream_and_frees_the_request(engine):
    request = make_request("long", max_tokens=200, ignore_eos=True)
    outputs = []
    async with aclosing(generate(engine, request)) as stream:
        async for output in stream:
            outputs.append(output)
            if len(outputs) == 2:
                assert engine.abort("long") is True
                assert engine.abort("long") is False  # idempotent
    last = outputs[-1]
    # tokens sampled before the abort landed may be coalesced into the CANCELLED output
    assert (last.finish_reason, last.num_prompt_tokens) == (FinishReason.CANCELLED, 8)
    assert sum(len(o.new_token_ids) for o in outputs) < 200
    load = engine.load()
    assert (load.num_running, load.num_aborted_total) == (0, 1)
    assert engine.abort("long") is False
    assert engine.abort("never-seen") is False


async def test_closing_the_generator_early_aborts(engine):
    async with aclosing(generate(engine, make_request("early", max_tokens=200, ignore_eos=True))) as stream:
        async for output in stream:
            break
    await wait_until(lambda: engine.load().num_aborted_total == 1)
    load = engine.load()
    assert (load.num_running, load.num_waiting) == (0, 0)


async def test_cancelling_the_consumer_aborts(engine):
    first_output = asyncio.Event()

    async def consume():
        async for _ in generate(engine, make_request("cancelled", max_tokens=200, ignore_eos=True)):
            first_output.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_output.wait(), HANG_GUARD_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine.load().num_aborted_total == 1)
    assert engine.load().num_running == 0
    # The id is free again and the engine still serves.
    outputs = await collect_once_free(engine, make_request("cancelled", max_tokens=3, ignore_eos=True))
    assert outputs[-1].finish_reason is FinishReason.LENGTH


async def test_duplicate_in_flight_request_id_is_rejected(engine):
    async with aclosing(generate(engine, make_request("dup", max_tokens=200, ignore_eos=True))) as stream:
        await anext(stream)
        with pytest.raises(InvalidArgument) as error:
            await anext(generate(engine, make_request("dup")))
    assert error.value.message == "request_id: 'dup' is already in flight"


class FailingStepCore(HFEngineCore):
    """Fault injection: the next step() raises a plain error (the core names no request)."""

    num_failures_left = 1

    def step(self):
        if self.num_failures_left:
            self.num_failures_left -= 1
            raise RuntimeError("injected step failure")
        return super().step()


class FailingForwardCore(HFEngineCore):
    """Fault injection inside the model call: HFEngineCore names the one failed request."""

    num_failures_left = 0

    def _forward(self, running):
        if self.num_failures_left:
            self.num_failures_left -= 1
            raise RuntimeError("injected forward failure")
        return super()._forward(running)


async def test_a_failing_step_errors_all_unnamed_requests_and_keeps_serving(tiny_model_dir):
    engine = AsyncEngine(EngineThread(FailingStepCore(hf_config(tiny_model_dir))))
    await engine.start()
    try:
        outputs = await collect(engine, make_request("doomed", max_tokens=5))
        assert [(o.finish_reason, o.error_message) for o in outputs] == [
            (FinishReason.ERROR, "engine step failed: RuntimeError: injected step failure")
        ]
        load = engine.load()
        assert (load.num_running, load.num_waiting) == (0, 0)  # aborted in the core: nothing held
        outputs = await collect(engine, make_request("after", max_tokens=5, ignore_eos=True))
        assert [o.finish_reason for o in outputs][-1] is FinishReason.LENGTH
    finally:
        await engine.shutdown(drain_timeout_s=0.0)


async def test_a_failing_forward_errors_only_its_request(tiny_model_dir):
    core = FailingForwardCore(hf_config(tiny_model_dir))
    engine = AsyncEngine(EngineThread(core))
    await engine.start()
    try:
        first = make_request("first", max_tokens=4, ignore_eos=True)
        second = make_request("second", max_tokens=4, ignore_eos=True)
        core.num_failures_left = 1  # set before the requests exist: the first forward fails
        first_outputs, second_outputs = await asyncio.gather(collect(engine, first), collect(engine, second))
        assert [(o.finish_reason, o.error_message) for o in first_outputs] == [
            (FinishReason.ERROR, "engine step failed: StepFailed: RuntimeError: injected forward failure")
        ]
        assert len(second_outputs) == 4 and second_outputs[-1].finish_reason is FinishReason.LENGTH
    finally:
        await engine.shutdown(drain_timeout_s=0.0)


async def test_shutdown_drains_running_requests_and_refuses_new_ones(tiny_model_dir):
    engine = AsyncEngine(EngineThread(HFEngineCore(hf_config(tiny_model_dir))))
    await engine.start()
    stream = generate(engine, make_request("draining", max_tokens=30, ignore_eos=True))
    first = await anext(stream)
    shutdown = asyncio.create_task(engine.shutdown(drain_timeout_s=HANG_GUARD_S))
    await asyncio.sleep(0)  # let shutdown stop accepting
    with pytest.raises(Unavailable):
        await anext(generate(engine, make_request("late")))
    rest = [output async for output in stream]
    await asyncio.wait_for(shutdown, HANG_GUARD_S)
    # Tokens, not outputs: a reader scheduled late gets several tokens merged into one output.
    assert sum(len(output.new_token_ids) for output in [first, *rest]) == 30
    assert rest[-1].finish_reason is FinishReason.LENGTH


async def test_shutdown_aborts_what_the_drain_timeout_leaves(tiny_model_dir):
    engine = AsyncEngine(EngineThread(HFEngineCore(hf_config(tiny_model_dir))))
    await engine.start()
    stream = generate(engine, make_request("too-long", max_tokens=240, ignore_eos=True))
    await anext(stream)
    await asyncio.wait_for(engine.shutdown(drain_timeout_s=0.0), HANG_GUARD_S)
    rest = [output async for output in stream]
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert engine.load().num_aborted_total == 1

"""AsyncEngine over an EngineProcess (the torch core in a process of its own) on the tiny
checkpoint: same tokens as the core driven directly, coalescing, aborts, start-up failures and a
dying process; and the engine loop's deadlines at the step boundary."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import time

import pytest

from llmserve.errors import Unavailable
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_process import EngineProcess
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.engine_output import EngineOutput, coalesced
from llmserve.inference.engine.engine_loop import CoreUpdate
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import FinishReason, TokenLogprob
from tests import engine_objects
from tests.engine_streams import HANG_GUARD_S, collect, generate, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="session")


def torch_config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model_path=model_dir, model_name="tiny", backend="torch", num_kv_blocks=64, **overrides)


make_request = functools.partial(engine_objects.make_request, temperature=0.0, ignore_eos=True)


def direct_tokens(model_dir, request: EngineRequest) -> dict[int, list[int]]:
    core = TorchEngineCore(torch_config(model_dir))
    core.add_request(request)
    tokens: dict[int, list[int]] = {}
    while core.has_requests_in_flight():
        for output in core.step():
            tokens.setdefault(output.sequence_index, []).extend(output.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
async def engine(tiny_model_dir):
    engine = AsyncEngine(EngineProcess(torch_config(tiny_model_dir)))
    await engine.start()
    yield engine
    await engine.shutdown(drain_timeout_s=5.0)


async def test_the_process_generates_what_the_core_generates(engine, tiny_model_dir):
    requests = [make_request(f"same-{i}", max_tokens=12 + i, n=1 + i % 2, temperature=0.7, seed=i) for i in range(4)]
    results = await asyncio.gather(*(collect(engine, request) for request in requests))
    for request, outputs in zip(requests, results):
        got: dict[int, list[int]] = {}
        for output in outputs:
            got.setdefault(output.sequence_index, []).extend(output.new_token_ids)
        assert got == direct_tokens(tiny_model_dir, request)
        finals = [output for output in outputs if output.is_finished]
        assert sorted(o.sequence_index for o in finals) == list(range(request.sampling.n))
        assert all(o.finish_reason is FinishReason.LENGTH for o in finals)
    await wait_until(lambda: engine.load().kv_blocks_used == 0)


async def test_an_abort_frees_the_blocks_in_the_process(engine):
    request = make_request("abort-me", max_tokens=240)
    outputs = []

    async def consume():
        async for output in generate(engine, request):
            outputs.append(output)
            if len(outputs) == 1:
                engine.abort("abort-me")

    await asyncio.wait_for(consume(), HANG_GUARD_S)
    assert outputs[-1].finish_reason is FinishReason.CANCELLED
    assert sum(len(o.new_token_ids) for o in outputs) < 240
    await wait_until(lambda: engine.load().kv_blocks_used == 0)


async def run_on_loop(model_dir, request: EngineRequest) -> list[EngineOutput]:
    """The request straight through an EngineLoop (on an EngineThread), no admission: the
    loop's own deadline handling is what is under test."""
    outputs: list[EngineOutput] = []
    done = asyncio.Event()

    def deliver(update: CoreUpdate) -> None:
        outputs.extend(update.outputs)
        if any(output.is_finished for output in update.outputs):
            done.set()

    thread = EngineThread(TorchEngineCore(torch_config(model_dir)))
    thread.start(asyncio.get_running_loop(), deliver)
    thread.add_request(request)
    try:
        await asyncio.wait_for(done.wait(), HANG_GUARD_S)
    finally:
        await thread.stop()
    return outputs


async def test_a_request_past_its_deadline_is_aborted_at_a_step_boundary(tiny_model_dir):
    deadline_ns = time.monotonic_ns() + 300_000_000
    outputs = await run_on_loop(tiny_model_dir, make_request("late", max_tokens=240, deadline_ns=deadline_ns))
    last = outputs[-1]
    if last.finish_reason is FinishReason.LENGTH:
        pytest.skip("this machine generated 240 tokens within 0.3 s: the deadline never came")
    assert (last.finish_reason, last.error_message) == (FinishReason.DEADLINE, "")
    assert time.monotonic_ns() >= deadline_ns


async def test_a_deadline_already_past_ends_the_request_before_any_token(tiny_model_dir):
    outputs = await run_on_loop(tiny_model_dir, make_request("too-late", deadline_ns=time.monotonic_ns() - 1))
    assert [(o.new_token_ids, o.finish_reason, o.error_message) for o in outputs] == [
        ([], FinishReason.DEADLINE, "")
    ]


async def test_a_bad_model_path_raises_the_core_error_in_the_server(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError, OSError)):
        EngineProcess(torch_config(tmp_path / "no-such-model"))


async def test_a_dying_process_fails_its_requests_and_refuses_new_ones(tiny_model_dir):
    children_before = set(multiprocessing.active_children())
    engine = AsyncEngine(EngineProcess(torch_config(tiny_model_dir)))
    (core_process,) = set(multiprocessing.active_children()) - children_before  # the engine-core process
    await engine.start()
    outputs = []

    async def consume():
        async for output in generate(engine, make_request("orphan", max_tokens=240)):
            outputs.append(output)
            if len(outputs) == 1:
                os.kill(core_process.pid, signal.SIGKILL)

    await asyncio.wait_for(consume(), HANG_GUARD_S)
    assert (outputs[-1].finish_reason, outputs[-1].error_message) == (FinishReason.ERROR, "the engine-core process died")
    with pytest.raises(Unavailable):
        engine.submit(make_request("after"), lambda output, is_last: None)
    await engine.shutdown(drain_timeout_s=1.0)


async def test_coalesced_joins_each_sequence_in_order():
    def out(rid, index, tokens, finish=None, logprob=False):
        logprobs = [TokenLogprob(t, -1.0) for t in tokens] if logprob else None
        return EngineOutput(rid, index, list(tokens), logprobs=logprobs, finish_reason=finish)

    merged = coalesced(
        [out("a", 0, [1]), out("b", 0, [7]), out("a", 1, [2]), out("a", 0, [3], logprob=True),
         out("a", 0, [4], FinishReason.STOP)]
    )  # fmt: skip
    assert [(o.request_id, o.sequence_index, o.new_token_ids, o.finish_reason) for o in merged] == [
        ("a", 0, [1, 3, 4], FinishReason.STOP),
        ("b", 0, [7], None),
        ("a", 1, [2], None),
    ]
    assert [lp.token_id for lp in merged[0].logprobs] == [3]

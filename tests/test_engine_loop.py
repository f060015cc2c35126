"""EngineLoop, the owner of the requests in the core's process, one iteration at a time
(`iterate`) over real cores on the tiny checkpoint: every sequence gets exactly one final
output, and the load's request totals are the loop's (a request counts once, when its last
sequence ends; aborted ones, by a command, a deadline or a stop, count in both totals)."""

from __future__ import annotations

import functools
import time

import pytest

from llmserve.engine_output import EngineOutput
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_loop import AbortRequest, AddRequest, EngineLoop, Iteration, Stop
from llmserve.inference.engine.hf_engine import HFEngineCore
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.sampling import FinishReason
from tests import engine_objects

MAX_ITERATIONS = 2000
make_request = functools.partial(engine_objects.make_request, max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(params=["torch", "hf"])
def loop(request, tiny_model_dir) -> EngineLoop:
    if request.param == "torch":
        core = TorchEngineCore(EngineConfig(model_path=tiny_model_dir, model_name="tiny", num_kv_blocks=64, max_num_seqs=2))
    else:
        core = HFEngineCore(EngineConfig(model_path=tiny_model_dir, model_name="tiny", backend="hf"))
    return EngineLoop(core)


def run_until_idle(loop: EngineLoop, commands=()) -> tuple[list[EngineOutput], Iteration]:
    """Iterate on `commands`, then with none, until nothing is in flight."""
    iteration = loop.iterate(list(commands))
    outputs = list(iteration.outputs)
    for _ in range(MAX_ITERATIONS):
        if not loop.has_work:
            return outputs, iteration
        iteration = loop.iterate([])
        outputs += iteration.outputs
    raise AssertionError("the loop never went idle")


def finals(outputs: list[EngineOutput]) -> dict[tuple[str, int], FinishReason]:
    """Each sequence's finish reason; fails on a sequence with two final outputs."""
    seen: dict[tuple[str, int], FinishReason] = {}
    for output in outputs:
        if output.is_finished:
            key = (output.request_id, output.sequence_index)
            assert key not in seen, f"two final outputs for {key}"
            seen[key] = output.finish_reason
    return seen


def test_a_request_of_n_sequences_counts_once(loop):
    outputs, iteration = run_until_idle(loop, [AddRequest(make_request("n3", n=3, temperature=1.0, seed=1))])
    assert finals(outputs) == {("n3", i): FinishReason.LENGTH for i in range(3)}
    assert (iteration.load.num_finished_total, iteration.load.num_aborted_total) == (1, 0)


def test_aborting_running_and_waiting_requests_counts_both_totals(loop):
    adds = [AddRequest(make_request(f"r{i}", max_tokens=50)) for i in range(3)]
    iteration = loop.iterate(adds)
    outputs = list(iteration.outputs) + loop.iterate([]).outputs
    load = loop.iterate([]).load
    assert load.num_running >= 1 and load.num_waiting >= 1  # r0 runs (with r1 on torch), r2 waits
    aborted = loop.iterate([AbortRequest("r1"), AbortRequest("r2"), AbortRequest("r2"), AbortRequest("nope")])
    assert {(o.request_id, o.finish_reason) for o in aborted.outputs if o.is_finished} >= {
        ("r1", FinishReason.CANCELLED), ("r2", FinishReason.CANCELLED)
    }
    rest, iteration = run_until_idle(loop)
    assert finals(outputs + aborted.outputs + rest) == {
        ("r0", 0): FinishReason.LENGTH, ("r1", 0): FinishReason.CANCELLED, ("r2", 0): FinishReason.CANCELLED
    }
    assert (iteration.load.num_finished_total, iteration.load.num_aborted_total) == (3, 2)
    assert (iteration.load.num_running, iteration.load.num_waiting, iteration.load.kv_blocks_used) == (0, 0, 0)


def test_a_deadline_ends_the_request_with_its_own_reason_and_counts_as_aborted(loop):
    outputs, iteration = run_until_idle(
        loop, [AddRequest(make_request("late", deadline_ns=time.monotonic_ns() - 1)), AddRequest(make_request("ok"))]
    )
    assert finals(outputs) == {("late", 0): FinishReason.DEADLINE, ("ok", 0): FinishReason.LENGTH}
    assert [o.new_token_ids for o in outputs if o.request_id == "late"] == [[]]
    assert (iteration.load.num_finished_total, iteration.load.num_aborted_total) == (2, 1)


def test_a_stop_cancels_everything_in_flight(loop):
    loop.iterate([AddRequest(make_request("a", max_tokens=100)), AddRequest(make_request("b", max_tokens=100))])
    iteration = loop.iterate([Stop()])
    assert iteration.is_stopping
    assert {o.request_id: o.finish_reason for o in iteration.outputs if o.is_finished} == {
        "a": FinishReason.CANCELLED, "b": FinishReason.CANCELLED
    }
    assert (iteration.load.num_finished_total, iteration.load.num_aborted_total) == (2, 2)
    assert not loop.has_work


def test_a_prompt_the_pool_cannot_hold_counts_as_finished_not_aborted(tiny_model_dir):
    core = TorchEngineCore(EngineConfig(model_path=tiny_model_dir, model_name="tiny", num_kv_blocks=2))
    loop = EngineLoop(core)
    outputs, iteration = run_until_idle(loop, [AddRequest(make_request("big", list(range(1, 41)), n=2))])
    assert finals(outputs) == {("big", 0): FinishReason.ERROR, ("big", 1): FinishReason.ERROR}
    assert (iteration.load.num_finished_total, iteration.load.num_aborted_total) == (1, 0)
    iteration = loop.iterate([AddRequest(make_request("big-aborted", list(range(1, 41)))), AbortRequest("big-aborted")])
    assert finals(iteration.outputs) == {("big-aborted", 0): FinishReason.CANCELLED}
    rest, iteration = run_until_idle(loop)
    assert rest == [] and (iteration.load.num_finished_total, iteration.load.num_aborted_total) == (2, 1)


def test_run_reports_each_step_with_its_period_since_the_previous_and_none_after_a_wait(loop):
    """The period (admission's step-time fit is on it) spans the loop's work between steps; a
    step after the loop waited for commands has none, so idle time is never counted as a step."""
    waits = [[AddRequest(make_request("a", max_tokens=4))], [Stop()]]  # what each wait for commands gets
    steps = []

    def take_commands(block: bool) -> list:
        return waits.pop(0) if block else []

    def emit(outputs, load, kv_events, step, replies) -> bool:
        if step is not None:
            steps.append(step)
        return True

    loop.run(take_commands, emit)
    assert steps and steps[0].period_s is None  # after the wait for the first command
    for step in steps[1:]:
        assert step.period_s is not None and step.period_s >= step.duration_s
        assert step.wall_s == step.period_s


def test_core_calls_are_answered_in_order_with_what_they_returned_or_raised(loop):
    """CallCore: the core's KV-pull methods, answered in the iteration that applied them; a
    refusal, a core without the method and a name outside CORE_CALLS come back as errors."""
    from llmserve.inference.engine.engine_loop import CallCore
    from llmserve.inference.engine.kv_block_import import KvPullRefused
    from llmserve.tensor_transport import local_identity

    pin = CallCore(1, "kv_pin", (make_request("p"), 0, local_identity("cpu")))
    iteration = loop.iterate([pin, CallCore(2, "kv_release", ([],)), CallCore(3, "step", ())])
    assert [reply.call_id for reply in iteration.replies] == [1, 2, 3]
    first, second, third = iteration.replies
    if isinstance(loop._core, TorchEngineCore):  # no --kv-pull: refused, by reason
        assert isinstance(first.error, KvPullRefused) and first.error.reason == "not_enabled"
        assert (second.result, second.error) == (None, None)
    else:  # hf has no KV pool of ours
        assert isinstance(first.error, NotImplementedError) and isinstance(second.error, NotImplementedError)
    assert isinstance(third.error, NotImplementedError)  # not a core call, whatever the core has
    assert loop.iterate([]).replies == []

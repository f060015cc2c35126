"""A step's outputs as columns (llmserve.engine_output.StepOutputs, issue 19): plain tokens as
three lists, EngineOutputs only for what carries more, and the engine-core process's message of
them (engine_process.to_wire / from_wire).

The oracle for the engine runs is each request generated alone on the same engine config
(greedy, so batching must change nothing; tests/test_torch_engine.py holds that engine to
transformers): a mixed batch with n > 1, logprobs, stop tokens, min_tokens, an abort and a
deadline mid-batch, and preemption in a small KV pool, read through the pipe's message, gives
every sequence the tokens it gets alone, exactly one final output, and frees every block.
"""

from __future__ import annotations

import pickle
import time
from collections import defaultdict

import pytest

from llmserve.engine_output import EngineOutput, StepOutputs, TokenColumns
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_loop import AbortRequest, AddRequest, EngineLoop
from llmserve.inference.engine.engine_outputs import step_outputs
from llmserve.inference.engine.engine_process import from_wire, to_wire
from llmserve.inference.engine.step_output import SampledTokens
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import FinishReason, SamplingParams, TokenLogprob
from tests import engine_objects

MAX_ITERATIONS = 2000


# --- the columns and the objects, without an engine ------------------------------------------


def test_a_step_without_finishes_or_logprobs_is_columns_only():
    seqs = [engine_objects.make_seq(seq_id=i) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.request_id, seq.sequence_index = f"r{i}", i % 2
    outputs = step_outputs(SampledTokens(seqs, range(3), [7, 8, 9]), {}, now_ns=0)
    assert outputs.outputs == []
    assert outputs.tokens == TokenColumns(["r0", "r1", "r2"], [0, 1, 0], [7, 8, 9])
    assert list(outputs) == [EngineOutput("r0", 0, [7]), EngineOutput("r1", 1, [8]), EngineOutput("r2", 0, [9])]


def test_finishes_and_logprobs_become_objects_and_the_rest_stay_columns():
    seqs = [engine_objects.make_seq(seq_id=i, output=[5]) for i in range(4)]
    for i, seq in enumerate(seqs):
        seq.request_id = f"r{i}"
    seqs[1].finish_reason = FinishReason.STOP
    logprob = TokenLogprob(token_id=12, logprob=-0.5, top_logprobs=())
    # rows 0 and 2 of the launch were dropped (finished before): kept rows 1, 3, 4, 5
    sampled = SampledTokens(seqs, [1, 3, 4, 5], [11, 12, 13, 14], finishes=[(0, FinishReason.STOP, 11)])
    outputs = step_outputs(sampled, {3: logprob}, now_ns=seqs[0].arrival_ns + 1000)
    final, with_logprob = outputs.outputs
    assert (final.request_id, final.new_token_ids, final.finish_reason, final.stop_token_id) == (
        "r0", [11], FinishReason.STOP, 11
    )
    assert final.num_completion_tokens == 1 and final.total_time_ns == 1000
    assert (with_logprob.request_id, with_logprob.logprobs, with_logprob.finish_reason) == ("r1", [logprob], None)
    assert outputs.tokens == TokenColumns(["r2", "r3"], [0, 0], [13, 14])
    assert [o.request_id for o in outputs] == ["r0", "r1", "r2", "r3"]


def test_step_outputs_read_as_a_list_of_engine_outputs():
    final = EngineOutput("a", 0, [], finish_reason=FinishReason.CANCELLED)
    outputs = StepOutputs([final], TokenColumns(["b"], [1], [4]))
    expected = [final, EngineOutput("b", 1, [4])]
    assert outputs == expected and len(outputs) == 2 and outputs[1] == expected[1]
    assert [final] + outputs == [final] + expected and outputs + [final] == expected + [final]
    assert StepOutputs.of(expected).outputs == expected and StepOutputs.of(outputs) is outputs
    assert not StepOutputs() and StepOutputs() == []


def test_the_pipe_message_carries_the_same_outputs():
    logprob = TokenLogprob(token_id=3, logprob=-1.0, top_logprobs=())
    objects = [EngineOutput("a", 0, [3], [logprob]), EngineOutput("b", 0, [], finish_reason=FinishReason.DEADLINE)]
    outputs = StepOutputs(objects, TokenColumns(["c", "d"], [0, 2], [5, 6]))
    assert from_wire(pickle.loads(pickle.dumps(to_wire(outputs)))) == outputs.expanded()
    assert from_wire(pickle.loads(pickle.dumps(to_wire(StepOutputs(objects))))) == objects


# --- a mixed batch on the engine, read through the pipe's message -----------------------------


def make_loop(model_dir, **overrides) -> EngineLoop:
    settings = dict(model_path=model_dir, model_name="tiny", num_kv_blocks=64, max_batched_tokens=64, max_num_seqs=8)
    settings.update(overrides)
    return EngineLoop(TorchEngineCore(EngineConfig(**settings)))


def prompt(length: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 390 + 5 for i in range(length)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def make_request(request_id: str, prompt_ids: list[int], sampling: SamplingParams, deadline_ns: int = 0) -> EngineRequest:
    return EngineRequest(request_id, prompt_ids, sampling, arrival_ns=time.monotonic_ns(), deadline_ns=deadline_ns)


class Collected:
    """Every output, read back from the engine-core process's message of each iteration."""

    def __init__(self):
        self.tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.logprobs: dict[tuple[str, int], list[TokenLogprob]] = defaultdict(list)
        self.finals: dict[tuple[str, int], EngineOutput] = {}

    def add(self, outputs: StepOutputs) -> None:
        assert all(not o.is_finished and o.logprobs is None for o in outputs.tokens.outputs())
        for output in from_wire(pickle.loads(pickle.dumps(to_wire(outputs)))):
            key = (output.request_id, output.sequence_index)
            assert key not in self.finals, f"an output for {key} after its final one"
            self.tokens[key] += output.new_token_ids
            self.logprobs[key] += output.logprobs or []
            if output.is_finished:
                self.finals[key] = output


def iterate(loop: EngineLoop, collected: Collected, commands=()) -> None:
    collected.add(loop.iterate(list(commands)).outputs)


def drain(loop: EngineLoop, collected: Collected) -> None:
    for _ in range(MAX_ITERATIONS):
        if not loop.has_work:
            return
        iterate(loop, collected)
    raise AssertionError("the loop never went idle")


def alone(model_dir, request: EngineRequest) -> Collected:
    loop, collected = make_loop(model_dir, num_kv_blocks=256), Collected()
    iterate(loop, collected, [AddRequest(request)])
    drain(loop, collected)
    return collected


@pytest.mark.parametrize("num_kv_blocks", [256, 8], ids=["roomy", "preempting"])
def test_a_mixed_batch_gives_each_sequence_what_it_gets_alone(tiny_model_dir, num_kv_blocks):
    plain_prompt = prompt(20, seed=1)
    plain_alone = alone(tiny_model_dir, make_request("x", plain_prompt, greedy(24))).tokens[("x", 0)]
    stop_token = plain_alone[9]
    first_stop = plain_alone.index(stop_token)
    requests = {
        "plain": make_request("plain", plain_prompt, greedy(24)),
        "short": make_request("short", prompt(7, seed=2), greedy(3)),
        "logprobs": make_request("logprobs", prompt(13, seed=3), greedy(16, logprobs=2)),
        "stop": make_request("stop", plain_prompt, greedy(24, stop_token_ids=[stop_token])),
        "min": make_request("min", plain_prompt, greedy(24, stop_token_ids=[stop_token], min_tokens=first_stop + 2)),
        "n2": make_request("n2", prompt(11, seed=4), SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2, ignore_eos=True)),
        "aborted": make_request("aborted", prompt(9, seed=5), greedy(40)),
        "deadline": make_request("deadline", prompt(17, seed=6), greedy(40)),
    }
    expected = {rid: alone(tiny_model_dir, make_request(rid, r.prompt_token_ids, r.sampling)) for rid, r in requests.items()}

    loop, collected = make_loop(tiny_model_dir, num_kv_blocks=num_kv_blocks), Collected()
    deadline = requests["deadline"]  # its deadline counts from now, after the runs alone
    requests["deadline"] = make_request("deadline", deadline.prompt_token_ids, deadline.sampling, time.monotonic_ns() + 300_000_000)
    iterate(loop, collected, [AddRequest(r) for r in requests.values()])
    while len(collected.tokens[("aborted", 0)]) < 3:
        iterate(loop, collected)
    iterate(loop, collected, [AbortRequest("aborted")])
    while not collected.tokens[("deadline", 0)] and ("deadline", 0) not in collected.finals:
        iterate(loop, collected)
    time.sleep(max(0.0, (requests["deadline"].deadline_ns - time.monotonic_ns()) / 1e9))  # past it now
    drain(loop, collected)

    for rid in ("plain", "short", "logprobs", "stop", "min", "n2"):
        for index in range(requests[rid].sampling.n):
            key = (rid, index)
            assert collected.tokens[key] == expected[rid].tokens[key], key
            final, expected_final = collected.finals[key], expected[rid].finals[key]
            assert (final.finish_reason, final.stop_token_id) == (expected_final.finish_reason, expected_final.stop_token_id)
            assert final.num_completion_tokens == len(collected.tokens[key])
    assert len(collected.tokens[("plain", 0)]) == 24 and len(collected.tokens[("short", 0)]) == 3  # max_tokens
    assert collected.finals[("short", 0)].finish_reason is FinishReason.LENGTH
    assert collected.tokens[("stop", 0)] == plain_alone[: first_stop + 1]
    assert collected.finals[("stop", 0)].stop_token_id == stop_token
    assert len(collected.tokens[("min", 0)]) > first_stop + 1  # min_tokens held the first stop token back
    assert collected.tokens[("n2", 0)] != collected.tokens[("n2", 1)]
    # every token of the logprobs request carries its logprob, and they are those it gets alone
    lp, lp_alone = collected.logprobs[("logprobs", 0)], expected["logprobs"].logprobs[("logprobs", 0)]
    assert [x.token_id for x in lp] == collected.tokens[("logprobs", 0)]
    assert [x.logprob for x in lp] == pytest.approx([x.logprob for x in lp_alone], abs=1e-4)
    assert all(len(x.top_logprobs) == 2 for x in lp)
    # the abort and the deadline end their sequences mid-batch, after a prefix of their tokens
    for rid, reason in (("aborted", FinishReason.CANCELLED), ("deadline", FinishReason.DEADLINE)):
        tokens = collected.tokens[(rid, 0)]
        assert collected.finals[(rid, 0)].finish_reason is reason
        assert tokens == expected[rid].tokens[(rid, 0)][: len(tokens)]
    assert len(collected.tokens[("aborted", 0)]) >= 3
    assert set(collected.finals) == {(rid, i) for rid, r in requests.items() for i in range(r.sampling.n)}
    load = loop.iterate([]).load
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    if num_kv_blocks == 8:
        assert load.num_preemptions_total > 0

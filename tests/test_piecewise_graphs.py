"""Piecewise CUDA graphs (engine/piecewise_graphs.py): the steps no whole-forward graph takes
run the model's pieces over static buffers with attention between them.

On CPU (the Triton interpreter) the pieces run uncaptured over the same buffers and padding as
a replay; the engine's tokens and logprobs must equal the portable backend's, and the steps
must have gone through the pieces. On CUDA (`gpu` marker) they are captured and replayed.
"""

from __future__ import annotations

from tests.triton_cpu import HAS_CUDA, HAS_TRITON, KERNEL_DEVICE  # noqa: I001  (before any kernel import)

import pytest

from llmserve.inference.engine.piecewise_graphs import PIECEWISE_GRAPH_TOKEN_SIZES, piecewise_graph_sizes
from tests.test_cuda_graphs import (
    assert_same_generations,
    run_scenario,
    run_scenario_recording_replays,
    scenario_engine,
)
from tests.test_torch_engine import Result, drain, greedy, make_engine, make_prompt, request

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")


def test_piecewise_graph_sizes_stop_at_the_step_budget_and_at_2048_tokens():
    assert piecewise_graph_sizes(8192) == piecewise_graph_sizes(2048) == PIECEWISE_GRAPH_TOKEN_SIZES
    assert piecewise_graph_sizes(300) == (16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 300)
    assert piecewise_graph_sizes(24) == (16, 24)
    assert piecewise_graph_sizes(8) == (8,)


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_piecewise_steps_match_the_portable_backend(arch, tiny_model_dirs):
    """The cuda-graph scenario (a step budget of 24: prompts in several chunks, chunks beside
    decodes) with the pieces on: the steps of several chunks and the mixed ones go through them,
    and every token and logprob is the portable backend's. Qwen3 has per-head q/k norms."""
    expected = run_scenario(scenario_engine(tiny_model_dirs[arch], "cpu", attention_backend="portable"))
    engine = scenario_engine(tiny_model_dirs[arch], KERNEL_DEVICE, attention_backend="triton", piecewise_graphs=True)
    piecewise = engine.runner.piecewise_graphs
    assert piecewise.sizes == (16, 24)
    assert piecewise.num_pieces == engine.runner.model.config.num_layers + 1

    results = run_scenario(engine)

    assert_same_generations(results, expected, tolerance=1e-4)
    assert piecewise.num_steps >= 2
    assert engine.runner.decode_graphs.num_steps >= 1 and engine.runner.prefill_graphs.num_steps >= 1


@needs_triton
def test_prompts_joining_a_decoding_batch_with_async_scheduling_match_the_portable_backend(tiny_model_dirs):
    """Prompts arrive one by one while others decode, with async scheduling: each joins the batch
    in a mixed step whose decodes' input ids are placeholders filled on the device from the step
    before, staged into the pieces' static ids. Each stream's tokens equal what it gets alone."""
    model_dir = tiny_model_dirs["llama"]
    prompts = {f"s{i}": make_prompt(7 + 5 * i, seed=60 + i) for i in range(5)}
    portable = make_engine(model_dir, attention_backend="portable")
    alone = {}
    for request_id, prompt in prompts.items():
        portable.add_request(request(request_id, prompt, greedy(10)))
        alone |= drain(portable)
    engine = make_engine(model_dir, device=KERNEL_DEVICE, attention_backend="triton", async_scheduling=True,
                         piecewise_graphs=True)
    results: dict[str, Result] = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request(request_id, prompt, greedy(10)))
        for _ in range(2):  # two steps: the next prompt arrives while this one decodes
            for output in engine.step():
                results.setdefault(output.request_id, Result()).add(output)
    drain(engine, results)
    for request_id in prompts:
        assert results[request_id].token_ids == alone[request_id].token_ids, request_id
        assert results[request_id].logprobs[0] == pytest.approx(alone[request_id].logprobs[0], abs=1e-4), request_id
    assert engine.runner.piecewise_graphs.num_steps >= 4  # every arrival after the first joined decodes
    assert engine.load().kv_blocks_used == 0


@needs_triton
def test_enforce_eager_builds_no_piecewise_graphs(tiny_model_dirs):
    runner = make_engine(tiny_model_dirs["llama"], device=KERNEL_DEVICE, attention_backend="triton",
                         enforce_eager=True, piecewise_graphs=True).runner
    assert runner.piecewise_graphs is None


@pytest.mark.gpu
@needs_cuda
def test_captured_pieces_match_eager_kernels_and_are_replayed(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    eager = run_scenario(scenario_engine(model_dir, "cuda", attention_backend="triton", enforce_eager=True))
    engine = scenario_engine(model_dir, "cuda", attention_backend="triton", piecewise_graphs=True)
    piecewise = engine.runner.piecewise_graphs
    captured = {graph for graphs in piecewise.captured_graphs.values() for graph in graphs}
    assert len(captured) == len(piecewise.sizes) * piecewise.num_pieces
    results, replays = run_scenario_recording_replays(engine)
    assert piecewise.num_steps >= 2
    assert sum(graph in captured for graph in replays) == piecewise.num_steps * piecewise.num_pieces
    assert_same_generations(results, eager, tolerance=1e-4)

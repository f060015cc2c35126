"""Decode and prefill CUDA graphs: graph size selection and padding (pure, CPU), the static
input buffers, and the engine on the triton attention backend against the portable one.

The engine-level tests run everywhere triton is installed: on CPU the Triton interpreter runs
the kernels and the static-buffer decode and prefill paths run uncaptured (the same padding and
buffers as a graph replay); on CUDA (`gpu` marker) the graphs are captured and replayed for real.
"""

from __future__ import annotations

from tests.triton_cpu import HAS_CUDA, HAS_TRITON, KERNEL_DEVICE  # noqa: I001  (before any kernel import)

import functools
import json

import pytest
import torch

from llmserve.buckets import DECODE_GRAPH_BATCH_SIZES
from llmserve.inference.engine.config import ATTENTION_BACKENDS
from llmserve.inference.engine.cuda_graphs import graph_batch_sizes, graph_size_for, pad_decode_step
from llmserve.inference.engine.prefill_graphs import pad_prefill_step, prefill_graph_sizes
from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.engine.static_inputs import StaticInputs
from llmserve.inference.engine.batch_inputs import build_step_inputs
from llmserve.inference.engine.decode_batch import DecodeBatch
from llmserve.inference.models.attention_backend import (
    BACKENDS,
    PADDING_SLOT,
    create_attention_backend,
    resolve_attention_backend,
)
from llmserve.inference.models.decoder_config import DecoderConfig
from tests import engine_objects
from tests.test_torch_engine import greedy, make_engine, make_prompt, request, run

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")


# --- graph sizes and padding (pure) -----------------------------------------------------------------


def test_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs():
    assert graph_batch_sizes(256) == tuple(b for b in DECODE_GRAPH_BATCH_SIZES if b < 256) + (256,)
    assert graph_batch_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(3, (1, 2, 4, 8)) == (1, 2, 3)


def test_graph_size_for_picks_the_smallest_size_that_fits():
    sizes = (1, 2, 4, 8, 16, 24)
    assert [graph_size_for(n, sizes) for n in (1, 2, 3, 4, 5, 16, 17, 24)] == [1, 2, 4, 4, 8, 16, 24, 24]
    assert graph_size_for(25, sizes) is None


make_seq = functools.partial(engine_objects.make_seq, max_tokens=4)


def step_inputs(batch: ScheduledBatch, block_size: int):
    """The batch's inputs, its decodes from a fresh persistent batch."""
    return build_step_inputs(batch, DecodeBatch(max_seqs_per_step=8, width=16, block_size=block_size))


def test_step_inputs_put_decodes_first_and_sample_only_finished_prompts():
    block_size = 4
    batch = ScheduledBatch()
    prefill = make_seq(range(10, 20), seq_id=1, block_ids=[7, 3, 9])  # 10 tokens, chunk of 6: does not sample
    decode = make_seq([5, 6, 7, 8, 9], seq_id=2, num_computed_tokens=4, block_ids=[2, 5])  # computes token 4 (position 4): samples
    tail = make_seq([1, 2, 3], seq_id=3, num_computed_tokens=2, block_ids=[8])  # a 1-token chunk that ends its prompt: samples
    batch.add(prefill, 6)
    batch.add(decode, 1)
    batch.add(tail, 1)

    step = step_inputs(batch, block_size)

    assert step.input_ids == [9, 3, 10, 11, 12, 13, 14, 15]
    assert step.positions == [4, 2, 0, 1, 2, 3, 4, 5]
    assert step.slot_mapping == [5 * 4 + 0, 8 * 4 + 2, 28, 29, 30, 31, 12, 13]
    assert step.decode_block_tables == [[2, 5], [8]]
    assert step.decode_context_lens == [5, 3]
    assert (step.prefill_query_starts, step.prefill_query_lens, step.prefill_context_lens) == ([2], [6], [6])
    assert step.prefill_block_tables == [[7, 3]]
    assert step.prefill_has_cached_prefix == [False]
    assert step.logits_indices == [0, 1]  # batch order: prefill (no sample), decode, tail
    assert not step.is_decode_only


def test_pad_decode_step_fills_spare_rows_with_no_op_tokens():
    batch = ScheduledBatch()
    batch.add(make_seq([4, 5, 6], seq_id=1, num_computed_tokens=2, block_ids=[3]), 1)
    batch.add(make_seq(range(40), seq_id=2, num_computed_tokens=39, block_ids=[1, 2, 6]), 1)
    step = step_inputs(batch, block_size=16)

    padded = pad_decode_step(step, 4)

    assert padded.input_ids == [6, 39, 0, 0]
    assert padded.positions == [2, 39, 0, 0]
    assert padded.slot_mapping == [3 * 16 + 2, 6 * 16 + 7, PADDING_SLOT, PADDING_SLOT]
    assert padded.context_lens == [3, 40, 0, 0]


def test_prefill_graph_sizes_stop_at_the_step_budget_and_at_1024_tokens():
    every = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
    assert prefill_graph_sizes(2048) == prefill_graph_sizes(1024) == every
    assert prefill_graph_sizes(300) == (16, 32, 64, 128, 192, 256, 300)
    assert prefill_graph_sizes(24) == (16, 24)
    assert prefill_graph_sizes(8) == (8,)


def test_pad_prefill_step_fills_spare_rows_with_no_op_tokens():
    batch = ScheduledBatch()
    batch.add(make_seq(range(100, 140), seq_id=1, num_computed_tokens=35, block_ids=[4, 9, 2]), 5)  # 35 cached, computes 35..39
    step = step_inputs(batch, block_size=16)

    padded = pad_prefill_step(step, 8)

    assert padded.input_ids == [135, 136, 137, 138, 139, 0, 0, 0]
    assert padded.positions == [35, 36, 37, 38, 39, 0, 0, 0]
    assert padded.slot_mapping == [2 * 16 + 3, 2 * 16 + 4, 2 * 16 + 5, 2 * 16 + 6, 2 * 16 + 7] + [PADDING_SLOT] * 3
    assert padded.block_table == [4, 9, 2]
    assert (padded.query_len, padded.context_len, padded.logits_index) == ([5], [40], [4])


def test_static_inputs_write_the_staged_prefix_of_each_field_and_keep_the_rest():
    inputs = StaticInputs({"ids": 4, "table": 3, "length": 1}, torch.device("cpu"))
    inputs.stage({"ids": [1, 2, 3, 4], "table": [7, 8, 9], "length": [4]})
    inputs.stage({"ids": [5, 6], "length": [2]})  # the other staging buffer: still all zeros
    assert inputs.fields["ids"].tolist() == [5, 6, 0, 0]
    assert inputs.fields["table"].tolist() == [0, 0, 0]
    assert inputs.fields["length"].tolist() == [2]
    inputs.stage({"table": [3]})  # the first staging buffer again: its older values come back
    assert [inputs.fields[name].tolist() for name in ("ids", "table", "length")] == [[1, 2, 3, 4], [3, 8, 9], [4]]


def test_decode_num_splits_fills_the_gpu_only_when_batches_are_small():
    pytest.importorskip("triton")
    from llmserve.inference.kernels.paged_decode import MAX_SPLITS, decode_num_splits

    assert decode_num_splits(1, 8, num_sms=132) == MAX_SPLITS
    assert decode_num_splits(4, 8, num_sms=132) == 8  # 9 wanted: the nearest power of two
    assert decode_num_splits(6, 8, num_sms=132) == 8  # 6 wanted: log2 2.58 rounds up
    assert decode_num_splits(48, 2, num_sms=132) == 4  # 3 wanted
    assert {decode_num_splits(n, h, num_sms=132) for n in range(1, 257) for h in (1, 2, 4, 8)} == {1, 2, 4, 8, 16}
    assert decode_num_splits(64, 8, num_sms=132) == 1
    assert decode_num_splits(256, 8, num_sms=132) == 1


def test_prefill_num_splits_split_only_few_tiles_over_long_contexts():
    pytest.importorskip("triton")
    from llmserve.inference.kernels.paged_prefill import prefill_num_splits

    # 12 query heads on 132 SMs: (max query len, chunks, longest context) -> splits
    assert prefill_num_splits(416, 1, 12, 4096, num_sms=132) == 4  # 7 tiles x 12 heads: 84 programs
    assert prefill_num_splits(512, 1, 12, 131072, num_sms=132) == 2  # a 512-token graph: 3 -> a power of 2
    assert prefill_num_splits(128, 1, 12, 131072, num_sms=132) == 8  # 11 -> 8
    assert prefill_num_splits(16, 1, 12, 4096, num_sms=132) == 16
    assert prefill_num_splits(16, 1, 12, 300, num_sms=132) == 1  # splits of < 256 keys do not pay
    assert prefill_num_splits(2048, 1, 12, 2048, num_sms=132) == 1  # 384 programs fill the GPU
    assert prefill_num_splits(416, 4, 12, 4096, num_sms=132) == 1


# --- the triton attention backend against the portable one -------------------------------------


def run_scenario(engine) -> dict:
    """Mixed prompt lengths (3 decodes pad to a graph of 4), chunked prefill, a prefix-cache hit
    (one 3-token chunk: a prefill graph of 16) and an n=2 request (copy-on-fork of a partial block)."""
    prompts = [make_prompt(n, seed=n) for n in (5, 34, 17)]
    results = run(engine, [request(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts)])
    results |= run(engine, [request("cached", prompts[1][:33] + [7, 8], greedy(4))])
    results |= run(engine, [request("forked", prompts[2], greedy(4, n=2))])
    assert engine.load().kv_blocks_used == 0
    return results


def scenario_engine(model_dir, device: str, **overrides):
    return make_engine(model_dir, device=device, max_batched_tokens=24, **overrides)


def assert_same_generations(results: dict, expected: dict, tolerance: float) -> None:
    assert results.keys() == expected.keys()
    for request_id, result in results.items():
        assert result.token_ids == expected[request_id].token_ids, request_id
        for index, logprobs in result.logprobs.items():
            assert logprobs == pytest.approx(expected[request_id].logprobs[index], abs=tolerance), request_id


@pytest.mark.parametrize("name", [n for n in ATTENTION_BACKENDS if n != "auto"])
def test_every_attention_backend_choice_has_an_implementation(name, tiny_model_dir):
    """A choice of --attention-backend without an entry in the registry would fail only at start."""
    entry = BACKENDS[name]
    if entry.package is not None:
        pytest.importorskip(entry.package)
    config = DecoderConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    backend = create_attention_backend(resolve_attention_backend(name, torch.device("cpu")), config, 16,
                                       torch.device("cpu"))
    assert backend.name == name


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_portable_backend(arch, tiny_model_dirs):
    expected = run_scenario(scenario_engine(tiny_model_dirs[arch], "cpu", attention_backend="portable"))
    engine = scenario_engine(tiny_model_dirs[arch], KERNEL_DEVICE, attention_backend="triton")
    results = run_scenario(engine)
    assert_same_generations(results, expected, tolerance=1e-4)
    assert engine.runner.prefill_graphs.sizes == (16, 24)
    assert engine.runner.prefill_graphs.num_steps >= 1  # the prefix-cache hit
    assert engine.runner.decode_graphs.num_steps >= 1


@needs_triton
def test_prefill_graph_steps_match_the_portable_backend(tiny_model_dirs):
    """Single-chunk prefills through the prefill graph path: a fresh prompt (padded 21 -> 32),
    then a 53-token prompt behind its 16 cached tokens (37 new, padded to 64, reading the cached
    block through the static block table), then a 3-token chunk after a 2-block hit."""
    model_dir = tiny_model_dirs["llama"]
    prompt = make_prompt(21, seed=5)
    requests = [[request("fresh", prompt, greedy(3))],
                [request("hit", prompt[:16] + make_prompt(37, seed=6), greedy(3))],
                [request("tail", prompt[:16] + make_prompt(19, seed=6), greedy(3))]]
    portable = make_engine(model_dir, attention_backend="portable")
    expected = {k: v for batch in requests for k, v in run(portable, batch).items()}
    engine = make_engine(model_dir, device=KERNEL_DEVICE, attention_backend="triton")
    graphs = engine.runner.prefill_graphs
    results = {}
    for batch in requests:
        before = graphs.num_steps
        results |= run(engine, batch)
        assert graphs.num_steps == before + 1, batch[0].request_id
    assert_same_generations(results, expected, tolerance=1e-4)


@needs_triton
def test_enforce_eager_builds_no_graphs(tiny_model_dirs):
    runner = make_engine(tiny_model_dirs["llama"], device=KERNEL_DEVICE, attention_backend="triton", enforce_eager=True).runner
    assert runner.decode_graphs is None and runner.prefill_graphs is None


def test_float8_kv_cache_needs_the_triton_backend(tiny_model_dirs):
    with pytest.raises(ValueError, match="fp8' needs the triton attention backend, not 'portable'"):
        make_engine(tiny_model_dirs["llama"], attention_backend="portable", kv_cache_dtype="fp8")


@needs_triton
def test_float8_kv_cache_generates_close_to_the_full_precision_cache(tiny_model_dirs):
    """e4m3 K/V (3 mantissa bits): logprobs move by a few hundredths on the tiny model; the pool
    takes one byte per element."""
    model_dir = tiny_model_dirs["llama"]
    device = KERNEL_DEVICE
    full = make_engine(model_dir, device=device, attention_backend="triton")
    fp8 = make_engine(model_dir, device=device, attention_backend="triton", kv_cache_dtype="fp8")
    assert fp8.runner.kv_cache.num_bytes * full.runner.kv_cache.data.element_size() == full.runner.kv_cache.num_bytes
    prompt = make_prompt(21, seed=3)
    expected = run(full, [request("r", prompt, greedy(6))])["r"]
    result = run(fp8, [request("r", prompt, greedy(6))])["r"]
    assert result.logprobs[0] == pytest.approx(expected.logprobs[0], abs=0.1)


@pytest.mark.gpu
@needs_cuda
def test_captured_graphs_match_eager_kernels_and_are_used(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    eager = run_scenario(scenario_engine(model_dir, "cuda", attention_backend="triton", enforce_eager=True))
    engine = scenario_engine(model_dir, "cuda", attention_backend="triton")
    for graphs in (engine.runner.decode_graphs, engine.runner.prefill_graphs):
        assert set(graphs.captured_graphs) == set(graphs.sizes)
    captured = {*engine.runner.decode_graphs.captured_graphs.values(), *engine.runner.prefill_graphs.captured_graphs.values()}
    results, replays = run_scenario_recording_replays(engine)
    assert set(replays) <= captured
    assert engine.runner.prefill_graphs.num_steps >= 1 and engine.runner.decode_graphs.num_steps >= 1
    assert len(replays) == engine.runner.prefill_graphs.num_steps + engine.runner.decode_graphs.num_steps
    assert_same_generations(results, eager, tolerance=1e-4)


def run_scenario_recording_replays(engine) -> tuple[dict, list]:
    """run_scenario's results, and every CUDA graph replayed meanwhile, in order."""
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = lambda self: (replays.append(self), replay(self))[1]
    try:
        return run_scenario(engine), replays
    finally:
        torch.cuda.CUDAGraph.replay = replay

"""Decode CUDA graphs: graph size selection and padding (pure, CPU), and the engine on the
triton attention backend against the portable one.

The engine-level tests run everywhere triton is installed: on CPU the Triton interpreter runs
the kernels and the static-buffer decode path runs uncaptured (the same padding and buffers as
a graph replay); on CUDA (`gpu` marker) the graphs are captured and replayed for real.
"""

from __future__ import annotations

from tests.triton_cpu import HAS_CUDA, HAS_TRITON  # noqa: I001  (before any kernel import)

import json

import pytest
import torch

from llmserve.buckets import DECODE_GRAPH_BATCH_SIZES
from llmserve.inference.engine.config import ATTENTION_BACKENDS
from llmserve.inference.engine.cuda_graphs import graph_batch_sizes, graph_size_for, pad_decode_step
from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.engine.sequence import Sequence
from llmserve.inference.engine.step_inputs import build_step_inputs
from llmserve.inference.models.attention_backend import (
    BACKENDS,
    PADDING_SLOT,
    create_attention_backend,
    resolve_attention_backend,
)
from llmserve.inference.models.decoder_config import DecoderConfig
from llmserve.sampling import SamplingParams
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


def make_seq(seq_id: int, token_ids: list[int], num_computed: int, block_ids: list[int]) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(token_ids), len(token_ids), SamplingParams(max_tokens=4))
    seq.num_computed_tokens = num_computed
    seq.block_ids = block_ids
    return seq


def test_step_inputs_put_decodes_first_and_sample_only_finished_prompts():
    block_size = 4
    batch = ScheduledBatch()
    prefill = make_seq(1, list(range(10, 20)), 0, [7, 3, 9])  # 10 tokens, chunk of 6: does not sample
    decode = make_seq(2, [5, 6, 7, 8, 9], 4, [2, 5])  # computes token 4 (position 4): samples
    tail = make_seq(3, [1, 2, 3], 2, [8])  # a 1-token chunk that ends its prompt: samples
    batch.add(prefill, 6)
    batch.add(decode, 1)
    batch.add(tail, 1)

    step = build_step_inputs(batch, block_size)

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
    batch.add(make_seq(1, [4, 5, 6], 2, [3]), 1)
    batch.add(make_seq(2, list(range(40)), 39, [1, 2, 6]), 1)
    step = build_step_inputs(batch, block_size=16)

    padded = pad_decode_step(step, 4)

    assert padded.input_ids == [6, 39, 0, 0]
    assert padded.positions == [2, 39, 0, 0]
    assert padded.slot_mapping == [3 * 16 + 2, 6 * 16 + 7, PADDING_SLOT, PADDING_SLOT]
    assert padded.context_lens == [3, 40, 0, 0]
    assert padded.block_tables == [[3, 0, 0], [1, 2, 6], [0, 0, 0], [0, 0, 0]]


def test_decode_num_splits_fills_the_gpu_only_when_batches_are_small():
    pytest.importorskip("triton")
    from llmserve.inference.kernels.paged_decode import MAX_SPLITS, decode_num_splits

    assert decode_num_splits(1, 8, num_sms=132) == MAX_SPLITS
    assert decode_num_splits(4, 8, num_sms=132) == 9
    assert decode_num_splits(64, 8, num_sms=132) == 1
    assert decode_num_splits(256, 8, num_sms=132) == 1


# --- the triton attention backend against the portable one -------------------------------------


def run_scenario(model_dir, device: str, **overrides) -> dict:
    """Mixed prompt lengths (3 decodes pad to a graph of 4), chunked prefill, a prefix-cache hit
    and an n=2 request (copy-on-fork of a partial block)."""
    engine = make_engine(model_dir, device=device, max_batched_tokens=24, **overrides)
    prompts = [make_prompt(n, seed=n) for n in (5, 34, 17)]
    results = run(engine, [request(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts)])
    results |= run(engine, [request("cached", prompts[1][:33] + [7, 8], greedy(4))])
    results |= run(engine, [request("forked", prompts[2], greedy(4, n=2))])
    assert engine.load().kv_blocks_used == 0
    return results


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
    expected = run_scenario(tiny_model_dirs[arch], "cpu", attention_backend="portable")
    device = "cuda" if HAS_CUDA else "cpu"
    results = run_scenario(tiny_model_dirs[arch], device, attention_backend="triton")
    assert_same_generations(results, expected, tolerance=1e-4)


def test_float8_kv_cache_needs_the_triton_backend(tiny_model_dirs):
    with pytest.raises(ValueError, match="fp8' needs the triton attention backend, not 'portable'"):
        make_engine(tiny_model_dirs["llama"], attention_backend="portable", kv_cache_dtype="fp8")


@needs_triton
def test_float8_kv_cache_generates_close_to_the_full_precision_cache(tiny_model_dirs):
    """e4m3 K/V (3 mantissa bits): logprobs move by a few hundredths on the tiny model; the pool
    takes one byte per element."""
    model_dir = tiny_model_dirs["llama"]
    device = "cuda" if HAS_CUDA else "cpu"
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
    eager = run_scenario(model_dir, "cuda", attention_backend="triton", enforce_eager=True)
    engine = make_engine(model_dir, device="cuda", attention_backend="triton")
    graphs = engine.runner.decode_graphs
    assert graphs is not None and set(graphs._graphs) == set(graphs.sizes)
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = lambda self: (replays.append(self), replay(self))[1]
    try:
        results = run_scenario(model_dir, "cuda", attention_backend="triton")
    finally:
        torch.cuda.CUDAGraph.replay = replay
    assert replays, "no decode step replayed a graph"
    assert_same_generations(results, eager, tolerance=1e-4)

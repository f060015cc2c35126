"""The decoder split over tensor-parallel ranks (models/tensor_parallel.py) against the unsplit
decoder, on the tiny float32 models of every supported architecture.

Each rank is a real process joined over gloo (models/rank_group.py); every rank must compute the
same full logits as one process does, for a prefill chunk, a chunk over a cached prefix and a
decode step through the paged KV cache: 2 ranks (each rank one of the 2 KV heads) and 4 ranks
(more ranks than KV heads: each KV head replicated on 2 ranks), on the portable attention and
on the triton kernels (Triton's interpreter without a GPU). The slicing rules are checked
exactly on their own, without processes.
"""

from __future__ import annotations

from tests.triton_cpu import HAS_TRITON, KERNEL_DEVICE  # noqa: I001  (before any kernel import)

from pathlib import Path

import pytest
import torch

from llmserve.inference.engine.kv_cache import KVCache, KVCacheSpec
from llmserve.inference.engine.piecewise_graphs import PiecewiseGraphs
from llmserve.inference.models.attention_backend import create_attention_backend
from llmserve.inference.models.decoder_config import DecoderConfig, RopeConfig, check_splittable
from llmserve.inference.models.loader import load_model
from llmserve.inference.models.rank_group import SINGLE_RANK, RankGroup
from llmserve.inference.models.step_inputs import StepInputs
from llmserve.inference.models.tensor_parallel import TensorParallel
from llmserve.model_files import ModelFiles
from llmserve.tools.tiny_model import ARCHITECTURES
from tests.rank_runs import run_ranks

BLOCK_SIZE = 16
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(40)]
CHUNKS = ((0, 24), (24, 40))  # a prefill, then a chunk over the cached prefix
LOGITS_TOLERANCE = 1e-5


def step_logits(
    model_dir: Path, group: RankGroup, device: str = "cpu", attention_name: str = "portable", piecewise: bool = False
) -> list[torch.Tensor]:
    """The logits of every row of each step (two chunks, then one decode), on this rank; with
    `piecewise`, through the model's pieces between attention calls (engine/piecewise_graphs.py,
    uncaptured), whose all-reduces must pair with the other ranks'."""
    device = torch.device(device)
    files = ModelFiles.load(model_dir, "tiny")
    tp = TensorParallel(DecoderConfig.from_hf(files.config), group)
    local = tp.local_config()
    attention = create_attention_backend(attention_name, local, BLOCK_SIZE, device)
    model = load_model(model_dir, local, device, torch.float32, attention, tp=tp)
    cache = KVCache(KVCacheSpec(local.num_layers, BLOCK_SIZE, local.num_kv_heads, local.head_dim, torch.float32), 4, device)
    steps = [_chunk(start, end) for start, end in CHUNKS] + [_decode(len(PROMPT))]
    pieces = PiecewiseGraphs(model, cache.layers, attention, (16, 48), device, None) if piecewise else None
    logits = []
    with torch.inference_mode():
        for step in steps:
            if pieces is not None:
                logits.append(pieces.run(step, attention.build_metadata(step)).cpu())
                continue
            ids, positions = torch.tensor(step.input_ids, device=device), torch.tensor(step.positions, device=device)
            hidden = model(ids, positions, cache.layers, attention.build_metadata(step))
            logits.append(model.compute_logits(hidden).cpu())
    assert pieces is None or pieces.num_steps == len(steps)
    return logits


def _chunk(start: int, end: int) -> StepInputs:
    return StepInputs(
        input_ids=PROMPT[start:end], positions=list(range(start, end)), slot_mapping=list(range(start, end)),
        prefill_query_starts=[0], prefill_query_lens=[end - start], prefill_context_lens=[end],
        prefill_block_tables=[list(range(-(-end // BLOCK_SIZE)))], prefill_has_cached_prefix=[start > 0],
        logits_indices=list(range(end - start)),
    )  # fmt: skip


def _decode(position: int) -> StepInputs:
    return StepInputs(
        input_ids=[11], positions=[position], slot_mapping=[position],
        decode_block_tables=[list(range(position // BLOCK_SIZE + 1))], decode_context_lens=[position + 1],
        decode_seq_ids=[0], logits_indices=[0],
    )  # fmt: skip


def _logits_of_every_arch(
    group: RankGroup, model_dirs: dict[str, Path], device: str, attention_name: str, piecewise: bool = False
) -> dict:
    return {arch: [t.numpy() for t in step_logits(d, group, device, attention_name, piecewise)]
            for arch, d in model_dirs.items()}


def split_logits(
    model_dirs: dict[str, Path], world_size: int, tmp_path: Path, device: str = "cpu", attention_name: str = "portable",
    piecewise: bool = False,
) -> dict[int, dict]:
    """Every rank's logits (rank -> architecture -> per step), from `world_size` gloo processes."""
    store_path = str(tmp_path / f"rendezvous-{world_size}")
    return run_ranks(_logits_of_every_arch, world_size, store_path, model_dirs, device, attention_name, piecewise,
                     device=device)


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_ranks_compute_the_unsplit_logits(tiny_model_dirs, tmp_path, world_size):
    assert_same_logits(tiny_model_dirs, split_logits(tiny_model_dirs, world_size, tmp_path), world_size)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_split_ranks_on_the_triton_kernels_compute_the_unsplit_logits(tiny_model_dirs, tmp_path):
    """The triton backend's paged kernels and fused ops on a rank's shapes (2 q heads, 1 KV
    head), 2 ranks over gloo: on CUDA both on the one GPU, here under Triton's interpreter;
    float32, so the same tolerance."""
    gathered = split_logits(tiny_model_dirs, 2, tmp_path, KERNEL_DEVICE, "triton")
    assert_same_logits(tiny_model_dirs, gathered, 2, KERNEL_DEVICE, "triton")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_split_ranks_through_the_piecewise_graphs_compute_the_unsplit_logits(tiny_model_dirs, tmp_path):
    """The same steps through each rank's pieces (padded to 16 and 48 tokens), against the unsplit
    eager forward."""
    gathered = split_logits(tiny_model_dirs, 2, tmp_path, KERNEL_DEVICE, "triton", piecewise=True)
    assert_same_logits(tiny_model_dirs, gathered, 2, KERNEL_DEVICE, "triton")


def assert_same_logits(model_dirs, gathered, world_size: int, device: str = "cpu", attention_name: str = "portable"):
    for arch in ARCHITECTURES:
        expected = step_logits(model_dirs[arch], SINGLE_RANK, device, attention_name)
        for rank in range(world_size):
            for index, (got, want) in enumerate(zip(gathered[rank][arch], expected)):
                got = torch.from_numpy(got)
                where = f"{arch}, rank {rank} of {world_size}, step {index}"
                assert got.shape == want.shape, where
                assert (got - want).abs().max().item() < LOGITS_TOLERANCE, where
                assert torch.equal(got.argmax(-1), want.argmax(-1)), where


# --- the slicing rules, exactly --------------------------------------------------------------


def config(num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 10) -> DecoderConfig:
    return DecoderConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=8, intermediate_size=8, num_layers=1,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=2, rms_norm_eps=1e-5, max_position_embeddings=64,
        rope=RopeConfig(theta=10000.0),
    )  # fmt: skip


def rank_of(size: int, rank: int, **shape) -> TensorParallel:
    return TensorParallel(config(**shape), RankGroup(rank=rank, size=size))


def test_kv_heads_are_replicated_when_ranks_outnumber_them():
    k_proj = torch.arange(2 * 2 * 8).view(4, 8)  # 2 KV heads x head_dim 2 rows
    held = [rank_of(4, r).shard("model.layers.0.self_attn.k_proj.weight", k_proj) for r in range(4)]
    assert [h[:, 0].tolist() for h in held] == [[0, 8], [0, 8], [16, 24], [16, 24]]
    q_proj = torch.arange(8 * 8).view(8, 8)  # 4 heads: one per rank
    assert [rank_of(4, r).shard("model.layers.0.self_attn.q_proj.weight", q_proj)[:, 0].tolist()
            for r in range(4)] == [[0, 8], [16, 24], [32, 40], [48, 56]]  # fmt: skip


def test_the_vocabulary_is_padded_to_a_multiple_of_the_ranks():
    embed = torch.arange(10.0)[:, None].expand(10, 8)
    held = [rank_of(4, r).shard("model.embed_tokens.weight", embed)[:, 0].tolist() for r in range(4)]
    assert held == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 0]]


def test_a_row_split_bias_is_held_by_rank_0_only():
    bias = torch.ones(8)
    assert [rank_of(2, r).shard("model.layers.0.mlp.down_proj.bias", bias).sum().item() for r in (0, 1)] == [8, 0]
    down = torch.arange(64.0).view(8, 8)
    assert rank_of(2, 1).shard("model.layers.0.mlp.down_proj.weight", down)[0].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize(
    ("size", "shape", "named"),
    [(3, {}, "attention heads"), (4, {"num_heads": 12, "num_kv_heads": 3}, "KV heads"), (0, {}, "at least 1")],
)
def test_an_unsplittable_shape_is_refused_naming_it(size, shape, named):
    with pytest.raises(ValueError, match=named):
        check_splittable(config(**shape), size)


def test_each_rank_takes_the_gpu_after_its_replicas_first():
    """Rank r on cuda:B+r, B the index --device names: replicas of one host on GPUs of their own."""
    from llmserve.inference.engine.config import EngineConfig
    from llmserve.inference.engine.rank_worker import rank_config

    def devices(device: str) -> list[str]:
        config = EngineConfig(model_path=Path("unused"), model_name="unused", device=device, tensor_parallel_size=2)
        return [rank_config(config, rank).device for rank in range(2)]

    assert devices("cuda") == ["cuda:0", "cuda:1"]
    assert devices("cuda:2") == ["cuda:2", "cuda:3"]
    assert devices("cpu") == ["cpu", "cpu"]

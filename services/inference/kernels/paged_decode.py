"""Paged decode attention: one new query token per sequence against its whole cached context.

K/V are read in place from the paged cache through each sequence's block table: no gather copy.
The grid is (sequence, kv head, context split). A program loads the query heads that share its
kv head (GQA: the group is padded to 16 rows so the scores are one tensor-core dot) and streams
the context in tiles of BLOCK_N tokens with an online softmax, so every K/V byte is read once
per step for the whole group.

Split-K: with few sequences (batch 1 has only num_kv_heads programs) the context is cut into
`num_splits` pieces whose partial results are merged by a second small kernel (kernels/split_kv.py,
shared with paged prefill); each split derives its range from the context length at run time. A
sequence with context length 0 (a padding row of a decode graph) gets a zero output.

The cache may hold float8 (e4m3, scale 1): tiles are widened to the query dtype after loading,
so the kernel reads half the bytes, but measured on an H200 it reaches only ~2.1 TB/s of
float8 (0.50 ms vs 0.53 ms on bfloat16 at batch 256 x 2048; docs/benchmarks.md lists the
variants tried: widening to float16, CUDA-core dots without the 16-row padding). The
block-table stride changes from step to step in eager runs, so it is not a specialization key
(a new key means a recompile, ~1 s, mid-request).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmserve.inference.kernels.common import dot_is_ieee, next_power_of_2
from llmserve.inference.kernels.paged_kv import LOG2E, online_softmax_init, online_softmax_step, tile_scores
from llmserve.inference.kernels.split_kv import MAX_SPLITS, merge_splits, split_scratch, splits_to_fill, store_partial

# Launch configuration: tokens per K/V tile, warps, software-pipeline depth (bench/bench_gpu.py
# sweeps these on the GPU before its kernels and throughput scenarios: decode_config_sweep).
DEFAULT_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 3}  # 0.528 ms at batch 256 x 2048 on an H200
# float8 cache: the fastest of the swept configs on an H200, 0.502 ms at batch 256 x 2048 (bf16
# cache with DEFAULT_CONFIG: 0.528 ms).
FP8_CONFIG = {"block_n": 128, "num_warps": 4, "num_stages": 2}
MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows


def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Context splits per (sequence, kv head) so that about two waves of programs fill the GPU,
    rounded to the nearest power of two (in ratio: 1.4-2.8 waves). NUM_SPLITS is a compile-time
    constant: with the counts 1-16 an eager step's batch (any size, decodes beside a prompt chunk)
    could ask for one that start-up never compiled, and compile it mid-request (~1 s on a fresh
    host); with five possible values, TritonAttention.warm_up compiles them all at start."""
    splits = splits_to_fill(num_seqs * num_kv_heads, num_sms, max_splits)
    return min(max_splits, 1 << round(math.log2(splits)))


@triton.jit(do_not_specialize=["sliding_window", "bt_stride"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_stats_ptr,
    scale, sliding_window,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    first_key = context_len * 0
    if HAS_WINDOW:
        first_key = tl.maximum(context_len - sliding_window, 0)
    per_split = tl.cdiv(tl.cdiv(context_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first_key + split * per_split
    hi = tl.minimum(lo + per_split, context_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    head_mask = g < GROUP
    dim_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    qk_scale = scale * LOG2E
    m_i, l_i, acc = online_softmax_init(GROUP_PAD, HEAD_DIM_PAD)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < hi
        s, v = tile_scores(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * bt_stride, keys, key_mask,
                           key_mask[None, :], kv_head, d, dim_mask, qk_scale, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, IEEE)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, IEEE)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & dim_mask[None, :],
        )
    else:
        row = (seq * NUM_KV_HEADS * GROUP + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        store_partial(part_acc_ptr, part_stats_ptr, row, head_mask, d, acc, m_i, l_i, HEAD_DIM_PAD)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, the new token included
    scale: float,
    num_splits: int = 1,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Attention of each sequence's single query token over its cached context; [num_seqs, num_heads, head_dim]."""
    if config is None:
        config = FP8_CONFIG if k_cache.element_size() == 1 else DEFAULT_CONFIG
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    group = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_dim)
    group_pad = max(MIN_GROUP_ROWS, next_power_of_2(group))  # tl.dot needs 16 rows: the GQA group is padded
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_acc, part_stats = split_scratch(num_seqs, num_heads, num_splits, head_dim, q.device)
    else:
        part_acc = part_stats = out  # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_acc, part_stats,
        scale, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=config["block_n"], NUM_SPLITS=num_splits, HAS_WINDOW=sliding_window is not None,
        IEEE=dot_is_ieee(q.dtype), num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    if num_splits > 1:
        merge_splits(part_acc, part_stats, out, num_splits)
    return out

"""Paged prefill attention: causal FlashAttention over prefill chunks, K/V read from the cache.

A chunk's own keys/values are written to the cache before this runs, so a chunk with a cached
prefix (chunked prefill, prefix-cache hit) and a fresh prompt read their context the same way:
through the block table. Query row i of a chunk sits at position
context_len - query_len + i and sees keys at positions <= its own (and, with a sliding window,
> position - window).

Grid: (query tile, chunk, query head x key split); all chunks of a step in one launch. Tiles
past a chunk's end do no work. K/V tiles are BLOCK_N tokens gathered through the block table;
the kv head is shared by GROUP query heads (their programs read the same K/V through L2). A
float8 cache is widened to the query dtype after loading; the block-table stride is not a
specialization key (it changes between steps).

Split-KV (kernels/split_kv.py, the decode kernel's merge): a chunk of a few hundred queries
over a long cached prefix has few tiles (416 queries: 7 tiles x 12 heads = 84 programs on 132
SMs), each walking thousands of keys. Then each tile's key range is cut into `num_splits`
parts, aligned to BLOCK_N, computed by separate programs and merged after
(prefill_num_splits picks the count: 1 keeps the single pass). The parts derive from the
lengths read at run time, so a fixed count serves a CUDA graph of any context length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.inference.kernels.common import dot_is_ieee, next_power_of_2
from llmserve.inference.kernels.paged_kv import LOG2E, online_softmax_init, online_softmax_step, tile_scores
from llmserve.inference.kernels.split_kv import merge_splits, split_scratch, splits_to_fill, store_partial

# Launch configuration (bench/bench_gpu.py --scenario kernels sweeps these on the GPU).
DEFAULT_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}
# A split shorter than this many keys costs more in partial writes and the merge than it saves.
MIN_KEYS_PER_SPLIT = 256


def prefill_num_splits(max_query_len: int, num_chunks: int, num_heads: int, max_context_len: int, num_sms: int,
                       block_m: int = DEFAULT_CONFIG["block_m"]) -> int:
    """Key splits per (tile, chunk, head) program: enough programs for about two waves on
    `num_sms`, each split at least MIN_KEYS_PER_SPLIT of the longest context, rounded down to a
    power of two. NUM_SPLITS is a compile-time constant: with five possible values,
    TritonAttention.warm_up compiles them all at start, rather than an eager step mid-request
    (~1 s each)."""
    num_programs = -(-max_query_len // block_m) * num_chunks * num_heads
    splits = min(splits_to_fill(num_programs, num_sms), max(1, max_context_len // MIN_KEYS_PER_SPLIT))
    return 1 << (splits.bit_length() - 1)


@triton.jit(do_not_specialize=["sliding_window", "bt_stride", "first_row"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_stats_ptr,
    block_tables_ptr, query_starts_ptr, query_lens_ptr, context_lens_ptr,
    scale, sliding_window, first_row,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    query_len = tl.load(query_lens_ptr + chunk)
    query_start = tl.load(query_starts_ptr + chunk)
    context_len = tl.load(context_lens_ptr + chunk)
    first_position = context_len - query_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    positions = first_position + rows
    d = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (query_start + rows)[:, None].to(tl.int64) * q_stride_t + head * q_stride_h + d[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    kv_head = head // GROUP
    # Keys up to the tile's last query position; nothing for a tile past the chunk's end.
    hi = tl.minimum(context_len, first_position + (tile + 1) * BLOCK_M)
    hi = tl.where(tile * BLOCK_M < query_len, hi, 0)
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(first_position + tile * BLOCK_M - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    if NUM_SPLITS > 1:  # this split's part of [lo, hi), whole K/V tiles each
        per_split = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * per_split
        hi = tl.minimum(lo + per_split, hi)

    qk_scale = scale * LOG2E
    m_i, l_i, acc = online_softmax_init(BLOCK_M, HEAD_DIM_PAD)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < hi
        visible = key_mask[None, :] & (keys[None, :] <= positions[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > positions[:, None] - sliding_window)
        s, v = tile_scores(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + chunk * bt_stride, keys, key_mask,
                           visible, kv_head, d, dim_mask, qk_scale, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, IEEE)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, IEEE)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + (query_start + rows)[:, None].to(tl.int64) * out_stride_t + head * out_stride_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )
    else:
        partial = ((query_start - first_row + rows).to(tl.int64) * (NUM_KV_HEADS * GROUP) + head) * NUM_SPLITS + split
        store_partial(part_acc_ptr, part_stats_ptr, partial, row_mask, d, acc, m_i, l_i, HEAD_DIM_PAD)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: rows of every chunk
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_chunks, max_blocks] int32
    query_starts: torch.Tensor,  # [num_chunks] int32: first row of each chunk in q
    query_lens: torch.Tensor,  # [num_chunks] int32
    context_lens: torch.Tensor,  # [num_chunks] int32: cached prefix + chunk
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    num_splits: int = 1,
    first_row: int = 0,
) -> torch.Tensor:
    """Causal attention of every chunk's queries over its context; rows of `out` outside the
    chunks are left untouched, except with num_splits > 1: then the chunks start at `first_row`
    (the rows before it, e.g. decodes, are untouched) and every row from there on is written
    (a row past the last chunk, e.g. a graph's padding row, gets an undefined value)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_chunks = query_lens.shape[0]
    if num_chunks == 0 or max_query_len == 0:
        return out
    config = DEFAULT_CONFIG if config is None else config
    if num_splits > 1:
        part_acc, part_stats = split_scratch(num_tokens - first_row, num_heads, num_splits, head_dim, q.device)
    else:
        part_acc = part_stats = out  # unused
    grid = (triton.cdiv(max_query_len, config["block_m"]), num_chunks, num_heads * num_splits)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_stats,
        block_tables, query_starts, query_lens, context_lens,
        scale, sliding_window or 0, first_row,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_M=config["block_m"], BLOCK_N=config["block_n"], NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None,
        IEEE=dot_is_ieee(q.dtype), num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    if num_splits > 1:
        merge_splits(part_acc, part_stats, out[first_row:], num_splits)
    return out

"""Pieces shared by the paged attention kernels (Triton device functions).

Both attention kernels stream a sequence's context in tiles of BLOCK_N tokens read in place
from the paged cache: token t of the sequence lives in block table[t // BLOCK_SIZE] at offset
t % BLOCK_SIZE, and its head `kv_head` at [slot, kv_head, :] of the [num_blocks * BLOCK_SIZE,
num_kv_heads, head_dim] cache. `load_kv_tile` does that gather for one tile (masked keys read
block 0 and come back as zeros); `tile_dot` is tl.dot with exact float32 when the model runs
in float32 (Triton's float32 default is tf32).

Both run the same online softmax over those tiles, in the exp2 domain (scores scaled by
scale * log2(e)): `online_softmax_init` is the state of a block of query rows before any key,
`tile_scores` a tile's masked scores and values, `online_softmax_step` folds them into the state.
The state is unnormalized: the output is acc / l_i, and split-KV stores (acc, m_i, l_i) as they
are for kernels/split_kv.py to merge.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Scores times this are in the exp2 domain. A constexpr: compiled kernels may read no other
# global (the interpreter on CPU reads any, so only a GPU run catches a plain float here).
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, table_ptr, keys, key_mask, kv_head, d, dim_mask,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """(k, v) [BLOCK_N, HEAD_DIM_PAD] in the cache dtype for context positions `keys`;
    `table_ptr` points at the sequence's block-table row."""
    pages = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0)
    slots = pages.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
    offsets = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def tile_dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def online_softmax_init(ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """(m_i, l_i, acc): running max [ROWS], running sum [ROWS], unnormalized output [ROWS,
    HEAD_DIM_PAD], all float32, for rows that have seen no key yet."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    return m_i, l_i, acc


@triton.jit
def tile_scores(
    q, k_cache_ptr, v_cache_ptr, table_ptr, keys, key_mask, visible, kv_head, d, dim_mask, qk_scale,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
):
    """(s, v) for one K/V tile: s [rows, BLOCK_N] float32 = q . k * qk_scale, -inf where not
    `visible` [rows, BLOCK_N]; v [BLOCK_N, HEAD_DIM_PAD] widened to q's dtype."""
    k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, keys, key_mask, kv_head,
                        d, dim_mask, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k, v = k.to(q.dtype), v.to(q.dtype)
    s = tile_dot(q, tl.trans(k), IEEE)
    return tl.where(visible, s * qk_scale, float("-inf")), v


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """The state (m_i, l_i, acc) after one more tile of scores `s` (exp2 domain) and values `v`."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that sees nothing yet (prefill: a causal or window mask hides the whole tile) has
    # m_new = -inf; exp2 against 0 keeps its p and alpha at 0 rather than NaN. Where m_new is
    # finite (every decode row: a tile holds at least one key) m_safe is m_new.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc

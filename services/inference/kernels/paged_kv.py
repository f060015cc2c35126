"""Pieces shared by the paged attention kernels (Triton device functions).

Both attention kernels stream a sequence's context in tiles of BLOCK_N tokens read in place
from the paged cache: token t of the sequence lives in block table[t // BLOCK_SIZE] at offset
t % BLOCK_SIZE, and its head `kv_head` at [slot, kv_head, :] of the [num_blocks * BLOCK_SIZE,
num_kv_heads, head_dim] cache. `load_kv_tile` does that gather for one tile (masked keys read
block 0 and come back as zeros); `tile_dot` is tl.dot with exact float32 when the model runs
in float32 (Triton's float32 default is tf32).
"""

from __future__ import annotations

import triton
import triton.language as tl


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

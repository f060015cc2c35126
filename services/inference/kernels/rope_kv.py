"""Rotary embedding of q and k fused with writing k and v into the paged cache.

One program per token: it rotates the token's query heads (written to a new contiguous q) and
key heads, and stores the rotated keys and the values at the token's cache slot, so after this
kernel attention reads all of K/V from the cache. Slot -1 marks a padding token (a decode CUDA
graph's spare rows): its q is still computed, nothing is written to the cache.

Rotate-half layout (the HF Llama convention): for j < head_dim / 2,
  out[j]        = x[j] * cos[j] - x[j + half] * sin[j]
  out[j + half] = x[j + half] * cos[j] + x[j] * sin[j]
with cos/sin float32 [num_tokens, head_dim / 2]; the arithmetic is float32 and rounds once.
A float8 (e4m3) cache stores k and v with scale 1, saturated to +-448 (e4m3 has no infinity).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.inference.kernels.common import next_power_of_2

FP8_E4M3_MAX = 448.0


@triton.jit
def _rotate(x_ptr, stride_h, heads, head_mask, j, j_mask, cos, sin, HALF: tl.constexpr):
    mask = head_mask[:, None] & j_mask[None, :]
    first = tl.load(x_ptr + heads[:, None] * stride_h + j[None, :], mask=mask, other=0.0).to(tl.float32)
    second = tl.load(x_ptr + heads[:, None] * stride_h + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
    return first * cos[None, :] - second * sin[None, :], second * cos[None, :] + first * sin[None, :]


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cos_stride_t,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, DIM_PAD: tl.constexpr, SATURATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, HALF_PAD)
    j_mask = j < HALF
    cos = tl.load(cos_ptr + t * cos_stride_t + j, mask=j_mask, other=0.0)
    sin = tl.load(sin_ptr + t * cos_stride_t + j, mask=j_mask, other=0.0)

    heads = tl.arange(0, HEADS_PAD)
    head_mask = heads < NUM_HEADS
    q1, q2 = _rotate(q_ptr + t * q_stride_t, q_stride_h, heads, head_mask, j, j_mask, cos, sin, HALF)
    q_mask = head_mask[:, None] & j_mask[None, :]
    q_out = q_out_ptr + t * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + j[None, :]
    tl.store(q_out, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_out + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slots_ptr + t).to(tl.int64)
    kv_heads = tl.arange(0, KV_HEADS_PAD)
    kv_head_mask = kv_heads < NUM_KV_HEADS
    k1, k2 = _rotate(k_ptr + t * k_stride_t, k_stride_h, kv_heads, kv_head_mask, j, j_mask, cos, sin, HALF)
    if SATURATE > 0:
        k1 = tl.minimum(tl.maximum(k1, -SATURATE), SATURATE)
        k2 = tl.minimum(tl.maximum(k2, -SATURATE), SATURATE)
    k_mask = kv_head_mask[:, None] & j_mask[None, :] & (slot >= 0)
    k_out = k_cache_ptr + slot * NUM_KV_HEADS * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + j[None, :]
    tl.store(k_out, k1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_out + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)

    d = tl.arange(0, DIM_PAD)
    v_mask = kv_head_mask[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + t * v_stride_t + kv_heads[:, None] * v_stride_h + d[None, :], mask=v_mask, other=0.0)
    if SATURATE > 0:
        v = tl.minimum(tl.maximum(v.to(tl.float32), -SATURATE), SATURATE)
    v_out = v_cache_ptr + slot * NUM_KV_HEADS * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + d[None, :]
    tl.store(v_out, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask & (slot >= 0))


def rope_and_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] (any token/head strides, unit dim stride)
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    cos: torch.Tensor,  # [num_tokens, head_dim // 2] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = do not store
) -> torch.Tensor:
    """Returns the rotated queries [num_tokens, num_heads, head_dim] (contiguous); the rotated
    keys and the values go to the cache."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and cos.stride(-1) == 1
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    _rope_write_kv_kernel[(num_tokens,)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_heads), KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HALF_PAD=next_power_of_2(head_dim // 2), DIM_PAD=next_power_of_2(head_dim),
        SATURATE=FP8_E4M3_MAX if k_cache.element_size() == 1 else 0.0,
        num_warps=4,
    )
    return q_out

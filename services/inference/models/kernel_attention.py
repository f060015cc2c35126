"""Attention through the Triton kernels (CUDA): rotary embedding fused with the cache write,
then paged decode for the leading single-token rows and paged prefill for the chunks.

Imported only when the runner enables kernels: it imports triton.
"""

from __future__ import annotations

import torch

from llmserve.inference.kernels.paged_decode import paged_decode_attention
from llmserve.inference.kernels.paged_prefill import paged_prefill_attention
from llmserve.inference.kernels.rope_kv import rope_and_write_kv
from llmserve.inference.models.attention import KernelAttentionMetadata


def kernel_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
    v: torch.Tensor,
    cos: torch.Tensor,  # [num_tokens, head_dim // 2] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: KernelAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim]: rotate q/k, store k/v at their slots, attend."""
    q = rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        paged_decode_attention(
            q[:num_decodes], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            scale, num_splits=meta.decode_num_splits, sliding_window=sliding_window, out=out[:num_decodes],
        )
    if meta.prefill_max_query_len:
        paged_prefill_attention(
            q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_starts, meta.prefill_query_lens,
            meta.prefill_context_lens, meta.prefill_max_query_len, scale, sliding_window=sliding_window, out=out,
        )
    return out

"""Attention over the paged KV cache, and the per-step metadata it reads.

The batch is one flat run of tokens, no padding: first the single-token sequences (decodes),
then the multi-token prefill chunks, each contiguous. Every new token's key/value is written to
its cache slot (`slot_mapping`, slot = block_id * block_size + offset) before attention reads the
cache, so a chunk attends to its cached prefix and to itself in the same way.

  decodes: one batched scaled_dot_product_attention over keys gathered from the cache through
           padded slot tables [num_decodes, max_context], masked by context length;
  prefills: one call per sequence (vectorized within the sequence), with a causal mask offset
           by the number of tokens already in the cache.

The gather costs a copy of the context per layer; it is the portable path (CPU). On CUDA the
model runner builds a KernelAttentionMetadata instead and the layers call the Triton kernels
(models/kernel_attention.py), which read the blocks in place through the block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of new tokens (more than one) within the flat batch."""

    query_start: int  # first row of the chunk in the flat batch
    num_query_tokens: int
    context_len: int  # tokens in the cache after this step: cached prefix + this chunk
    kv_slots: torch.Tensor | None  # [context_len] cache slots of the context; None: no cached prefix

    @property
    def query_slice(self) -> slice:
        return slice(self.query_start, self.query_start + self.num_query_tokens)


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs for one step, built once by the model runner and shared by layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: the cache slot of each new token
    num_decode_tokens: int  # the leading tokens, one per single-token sequence
    decode_kv_slots: torch.Tensor | None  # [num_decodes, max_context] int64, padded with slot 0
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64, including the new token
    prefills: list[PrefillChunk]
    _mask_cache: dict = field(default_factory=dict)  # (kind, index, window) -> bool mask

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_context] True where a key is visible."""
        key = ("decode", 0, sliding_window)
        if key not in self._mask_cache:
            key_positions = torch.arange(self.decode_kv_slots.shape[1], device=self.decode_kv_slots.device)
            context_lens = self.decode_context_lens[:, None]
            visible = key_positions[None, :] < context_lens
            if sliding_window is not None:
                visible &= key_positions[None, :] >= context_lens - sliding_window
            self._mask_cache[key] = visible[:, None, None, :]
        return self._mask_cache[key]

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """[num_query_tokens, context_len] True where visible; None means plain causal."""
        chunk = self.prefills[index]
        if chunk.kv_slots is None and sliding_window is None:
            return None
        key = ("prefill", index, sliding_window)
        if key not in self._mask_cache:
            device = self.slot_mapping.device
            first_position = chunk.context_len - chunk.num_query_tokens
            query_positions = torch.arange(first_position, chunk.context_len, device=device)[:, None]
            key_positions = torch.arange(chunk.context_len, device=device)[None, :]
            visible = key_positions <= query_positions
            if sliding_window is not None:
                visible &= key_positions > query_positions - sliding_window
            self._mask_cache[key] = visible
        return self._mask_cache[key]


@dataclass(slots=True)
class KernelAttentionMetadata:
    """What the Triton kernels read for one step. Tensors are int32 on the device; the same
    object, built over static buffers, is captured in a decode CUDA graph, so nothing here may
    need a host value that changes between replays (the host ints are fixed per graph)."""

    slot_mapping: torch.Tensor  # [num_tokens]: cache slot of each new token, -1 = padding row
    num_decode_tokens: int  # the leading tokens, one per single-token sequence
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor | None  # [num_decodes], the new token included; 0 = padding
    decode_num_splits: int = 1  # context splits of the decode kernel
    prefill_block_tables: torch.Tensor | None = None  # [num_chunks, max_blocks]
    prefill_query_starts: torch.Tensor | None = None  # [num_chunks]: first row in the flat batch
    prefill_query_lens: torch.Tensor | None = None  # [num_chunks]
    prefill_context_lens: torch.Tensor | None = None  # [num_chunks]: cached prefix + chunk
    prefill_max_query_len: int = 0


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new keys/values [num_tokens, num_kv_heads, head_dim] at their cache slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write k/v to the cache, then attend; returns [num_tokens, num_heads, head_dim]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], k_slots, v_slots, meta, scale, sliding_window)
    for index, chunk in enumerate(meta.prefills):
        rows = chunk.query_slice
        if chunk.kv_slots is None:  # the chunk is the whole context: use k/v as computed
            chunk_k, chunk_v = k[rows], v[rows]
        else:
            chunk_k, chunk_v = k_slots[chunk.kv_slots], v_slots[chunk.kv_slots]
        mask = meta.prefill_mask(index, sliding_window)
        attended = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],  # [1, num_heads, n, head_dim]
            chunk_k.transpose(0, 1)[None],  # [1, num_kv_heads, context, head_dim]
            chunk_v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = attended[0].transpose(0, 1)
    return out


def _decode_attention(q, k_slots, v_slots, meta: AttentionMetadata, scale: float, sliding_window: int | None):
    keys = k_slots[meta.decode_kv_slots]  # [num_decodes, max_context, num_kv_heads, head_dim]
    values = v_slots[meta.decode_kv_slots]
    attended = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [num_decodes, num_heads, 1, head_dim]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.decode_mask(sliding_window),
        scale=scale,
        enable_gqa=True,
    )
    return attended[:, :, 0, :]

"""The portable attention backend: attention over the paged KV cache by gathering keys and
values through slot tables, and the per-step metadata it reads.

The batch is one flat run of tokens, no padding: first the single-token sequences (decodes),
then the multi-token prefill chunks, each contiguous. Every new token's key/value is written to
its cache slot (`slot_mapping`, slot = block_id * block_size + offset) before attention reads the
cache, so a chunk attends to its cached prefix and to itself in the same way.

  decodes: one batched scaled_dot_product_attention over keys gathered from the cache through
           padded slot tables [num_decodes, max_context], masked by context length;
  prefills: one call per sequence (vectorized within the sequence), with a causal mask offset
           by the number of tokens already in the cache.

The gather costs a copy of the context per layer; this is the portable backend (any device,
the reference). The triton backend (models/triton_attention.py) reads the blocks in place
through the block tables instead. RoPE is applied to q/k here (full-width tables in the model
dtype, as transformers does), and the small ops are transformers' (REFERENCE_OPS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmserve.inference.models.step_inputs import StepInputs
from llmserve.inference.models.attention_backend import AttentionBackend, KVLayer, RopeTables
from llmserve.inference.models.layer_ops import REFERENCE_OPS
from llmserve.inference.models.rope import apply_rope, full_width_tables


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
class PortableAttentionMetadata:
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
    meta: PortableAttentionMetadata,
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


def _decode_attention(q, k_slots, v_slots, meta: PortableAttentionMetadata, scale: float, sliding_window: int | None):
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


class PortableAttention(AttentionBackend[PortableAttentionMetadata]):
    name = "portable"
    ops = REFERENCE_OPS

    def build_metadata(self, step: StepInputs, decode_block_tables: torch.Tensor | None = None) -> PortableAttentionMetadata:
        assert decode_block_tables is None, "the portable backend keeps no device block tables"
        num_decodes = step.num_decodes
        chunks = zip(step.prefill_query_starts, step.prefill_query_lens, step.prefill_context_lens,
                     step.prefill_block_tables, step.prefill_has_cached_prefix)
        return PortableAttentionMetadata(
            slot_mapping=self._to_device(step.slot_mapping),
            num_decode_tokens=num_decodes,
            decode_kv_slots=self._slot_table(step.decode_block_tables) if num_decodes else None,
            decode_context_lens=self._to_device(step.decode_context_lens) if num_decodes else None,
            prefills=[
                PrefillChunk(start, n, context_len, self._slot_table([table])[0, :context_len] if cached else None)
                for start, n, context_len, table, cached in chunks
            ],
        )

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        return full_width_tables(positions, inv_freq, dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeTables, kv_cache: KVLayer,
               meta: PortableAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return paged_attention(q, k, v, *kv_cache, meta, scale, sliding_window)

    def _slot_table(self, block_tables: list[list[int]]) -> torch.Tensor:
        """[num_seqs, max_blocks * block_size] cache slots of every position, padded with block 0."""
        blocks = self._block_table(block_tables)
        offsets = torch.arange(self.block_size, device=self.device)
        return (blocks[:, :, None] * self.block_size + offsets).reshape(len(block_tables), -1)

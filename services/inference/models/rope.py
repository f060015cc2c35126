"""Rotary position embedding: inverse frequencies (default, linear, llama3 scaling) and the
cos/sin tables of one step's positions, computed in float32 exactly as transformers does.

Two table layouts, one per consumer: full width [num_tokens, head_dim] in the model dtype for
`apply_rope` (rotate-half, the portable attention), half width [num_tokens, head_dim // 2] in
float32 for the fused RoPE + KV-write kernel (kernels/rope_kv.py).
"""

from __future__ import annotations

import math

import torch

from llmserve.inference.models.decoder_config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, computed exactly as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def full_width_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_tokens, head_dim] in `dtype` (the rotate-half layout of `apply_rope`)."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def half_width_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin [num_tokens, head_dim // 2] for the fused RoPE kernel."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]; cos/sin [num_tokens, head_dim] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

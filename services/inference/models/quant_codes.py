"""Symmetric per-row quantization to int8 and float8 e4m3 codes, and back: pure torch.

Both methods are symmetric with one float32 scale per output channel (row of the [N, K]
weight), scale = amax(|row|) / qmax, so every row uses the full code range and one outlier
channel cannot crush the resolution of the others; an all-zero row gets scale 1 (its codes
are 0 either way; 0 would turn dequantization into 0/0). Scales are computed once, at load,
from the checkpoint weights (no calibration data).

These functions are the reference of the quantized modules (models/quantization.py) and of the
per-token kernel (kernels/fp8_quant.py), bit for bit.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
INT8_MAX = 127


def channel_scales(weight: torch.Tensor, qmax: float) -> torch.Tensor:
    """float32 [N]: amax(|row|) / qmax per row of weight [N, K]; 1 for an all-zero row."""
    amax = weight.abs().amax(dim=1).float()
    # Multiplied by the float32 reciprocal rather than divided: torch on CUDA divides by a
    # scalar that way anyway (CPU divides exactly), so this is the one form that rounds the
    # same on CPU, in torch on CUDA and in kernels/fp8_quant.py. The codes' clamp absorbs the
    # last-bit difference from amax / qmax.
    return torch.where(amax == 0, torch.ones_like(amax), amax * (1.0 / qmax))


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 codes [N, K], float32 scales [N]); weight ~= codes * scales[:, None]
    with |error| <= scale / 2 (round to nearest; codes in [-127, 127], -128 unused: symmetric)."""
    scales = channel_scales(weight, INT8_MAX)
    codes = torch.round(weight.float() / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), scales


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn codes [N, K], float32 scales [N]); relative error <= 2^-4
    per element, or at most 2^-10 * scale absolute below e4m3's normal range (subnormals)."""
    scales = channel_scales(weight, FP8_E4M3_MAX)
    return _to_fp8(weight.float() / scales[:, None]), scales


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn codes [M, K], float32 scales [M, 1]): the per-token activation
    rule (the torch reference of kernels/fp8_quant.py, bit for bit)."""
    scales = channel_scales(x, FP8_E4M3_MAX)[:, None]
    return _to_fp8(x.float() / scales), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 codes * scales, for codes [N, K] with per-row scales [N] or [N, 1]."""
    return codes.float() * scales.reshape(-1, 1)


def _to_fp8(values: torch.Tensor) -> torch.Tensor:
    # torch's cast rounds to nearest even but turns anything past 448 into NaN (e4m3fn has no
    # infinity), so clamp first; by construction only rounding of x / scale can reach it.
    return values.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)

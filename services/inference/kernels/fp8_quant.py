"""Per-token (row-wise) dynamic quantization of activations to float8 e4m3 for W8A8 GEMMs.

x [num_tokens, K] -> (x_fp8 [num_tokens, K] float8_e4m3fn, scales [num_tokens, 1] float32) with
x ~= x_fp8 * scale per row and scale = amax(|row|) * (1/448) (448 = e4m3's largest finite value), so
each row's largest element lands on 448 and nothing saturates. An all-zero row gets scale 1
(its codes are zeros either way) rather than 0, which would make the GEMM's dequantization 0/0.

The arithmetic is bit-for-bit that of the torch reference (models/quantization.py,
`quantize_per_token_fp8`): float32 absolute max (order-free), the scale as amax times the
float32 reciprocal of 448 (how torch divides by a scalar on CUDA), the codes as an IEEE-rounded
division x / scale (`div_rn`: Triton's plain `/` on float32 is the approximate div.full), a
clamp to +-448, then a round-to-nearest-even cast. Tests compare codes and scales exactly.

One program per row, two passes over it in tiles of at most MAX_BLOCK columns (amax, then
quantize): any hidden size works; up to 16k columns (Llama 8B-70B's hidden sizes and 8B's
intermediate size) each pass is a single tile, and the second read of the row hits L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.inference.kernels.common import next_power_of_2

FP8_E4M3_MAX = 448.0
MAX_BLOCK = 16384


@triton.jit
def _per_token_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, x_stride, out_stride,
    K: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        x = tl.load(x_ptr + row * x_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_amax = tl.max(amax, 0)
    scale = tl.where(row_amax == 0.0, 1.0, row_amax * (1.0 / FP8_MAX))
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        x = tl.load(x_ptr + row * x_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(out_ptr + row * out_stride + start + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [num_tokens, K] (any float dtype, unit stride on K) -> (float8_e4m3fn codes
    [num_tokens, K], contiguous; float32 scales [num_tokens, 1])."""
    num_tokens, size = x.shape
    assert x.stride(-1) == 1
    out = torch.empty((num_tokens, size), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out, scales
    block = min(MAX_BLOCK, next_power_of_2(size))
    _per_token_fp8_kernel[(num_tokens,)](
        x, out, scales, x.stride(0), out.stride(0),
        K=size, BLOCK=block, FP8_MAX=FP8_E4M3_MAX, num_warps=min(16, max(1, block // 1024)),
    )
    return out, scales

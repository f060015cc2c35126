"""SwiGLU for a fused gate/up projection: out = silu(gate) * up in one pass (float32, one rounding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * size] (gate first) -> [num_tokens, size]."""
    num_tokens, width = gate_up.shape
    size = width // 2
    assert gate_up.stride(-1) == 1
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=BLOCK, num_warps=4
    )
    return out

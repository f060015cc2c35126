"""The small ops as Triton kernels (the triton attention backend's LayerOps): RMSNorm fused with
the residual add, SwiGLU in one pass, and float32 outputs for the projections that feed the
residual stream and the logits.

Same math as models/layer_ops.ReferenceOps with fewer roundings: the residual stream stays
float32 (kernels/rms_norm.py), and three of the roundings a bfloat16 forward makes are skipped.
Imports triton.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.inference.kernels.activation import silu_and_mul
from llmserve.inference.kernels.rms_norm import rms_norm
from llmserve.inference.models.layers import RMSNorm


def float32_output_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) with cuBLAS's float32 accumulator written out instead of rounded to x's 16-bit
    dtype (CUDA); float32 models, CPU and quantized layers get linear(x). Used where the output
    is not a GEMM input: o_proj and down_proj (added to the float32 residual stream) and the
    lm_head (float32 logits). Measured on an H200: as fast as a bf16 output at decode sizes,
    ~15% slower at 4k-token prefill (docs/benchmarks.md)."""
    if type(linear) is not nn.Linear or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return linear(x)
    out = torch.mm(x, linear.weight.t(), out_dtype=torch.float32)
    return out if linear.bias is None else out + linear.bias.float()


class TritonOps:
    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, norm.weight, norm.eps)[0]

    def add_and_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, norm.weight, norm.eps, residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def residual_projection(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return float32_output_linear(linear, x)

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return float32_output_linear(lm_head, hidden)


TRITON_OPS = TritonOps()

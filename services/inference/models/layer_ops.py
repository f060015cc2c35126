"""The small per-layer ops the decoder calls between its GEMMs and attention, as one interface.

An attention backend hands the model its LayerOps (AttentionBackend.ops): fused kernels where
it has them (models/triton_ops.py), else REFERENCE_OPS, transformers' ops one by one. The model
calls these and nothing else, so it has one code path whatever runs underneath.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.inference.models.layers import RMSNorm


class LayerOps(Protocol):
    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """norm(x) of hidden states [num_tokens, hidden] (the first layer: no residual yet)."""

    def add_and_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: gate_up [num_tokens, 2 * size] (gate first) -> silu(gate) * up [num_tokens, size]."""

    def residual_projection(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """linear(x) for a projection whose output is added to the residual stream (o_proj, down_proj)."""

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_rows, vocab_size]."""


class ReferenceOps:
    """transformers' implementation op for op: the residual stream in the model dtype, rounded
    after every add; every projection's output rounded to the model dtype."""

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def add_and_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return norm(residual), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def residual_projection(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return linear(x)

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head(hidden).float()


REFERENCE_OPS = ReferenceOps()

"""How the kernel and quantization tests compare an output with its reference."""

from __future__ import annotations

import torch


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius), computed in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import torch


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def dot_is_ieee(dtype: torch.dtype) -> bool:
    """float32 models ask for exact float32 dots (Triton's default for float32 is tf32)."""
    return dtype == torch.float32

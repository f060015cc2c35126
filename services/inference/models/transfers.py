"""Host values to the device without a hidden host sync."""

from __future__ import annotations

import torch


def device_tensor(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (block ids, slots, sampling parameters) -> a device tensor without a hidden
    sync: a plain copy from pageable memory waits for the device, so on CUDA the values go
    through pinned memory, non_blocking."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor

"""Host values to the device without a hidden host sync."""

from __future__ import annotations

import numpy as np
import torch


def device_tensor(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (block ids, slots, sampling parameters) -> a device tensor without a hidden
    sync: a plain copy from pageable memory waits for the device, so on CUDA the values go
    through pinned memory, non_blocking."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


# Each list of device_int32 starts at a multiple of 16 bytes: Triton specializes a kernel on
# whether each pointer argument is 16-byte aligned, so unaligned views would compile (seconds,
# mid-serving) and run other variants of the attention kernels.
ALIGN_INT32S = 4


def aligned_int32s(length: int) -> int:
    """`length` int32s rounded up to the next 16-byte boundary: where the next aligned field starts."""
    return -(-length // ALIGN_INT32S) * ALIGN_INT32S


def device_int32(value_lists: list, device: torch.device) -> list[torch.Tensor]:
    """Several int lists or numpy arrays as int32 device tensors (16-byte aligned views of one),
    in one host-to-device copy: a step's small inputs each cost ~30 µs of host time sent alone."""
    lengths = [len(values) for values in value_lists]
    padded_lengths = [aligned_int32s(length) for length in lengths]
    flat = np.zeros(sum(padded_lengths), dtype=np.int32)
    start = 0
    for values, length, padded in zip(value_lists, lengths, padded_lengths):
        flat[start : start + length] = values
        start += padded
    tensor = torch.from_numpy(flat)
    if device.type == "cuda":
        tensor = tensor.pin_memory().to(device, non_blocking=True)
    return [part[:length] for part, length in zip(tensor.split(padded_lengths), lengths)]

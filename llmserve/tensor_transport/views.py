"""Reading a TensorRef: the view it names in a region's bytes, and its bytes for the inline path.

One function for both sides: the producer reads a ref out of its own region (to send it inline),
the consumer out of its mapping of the same region, so they cannot disagree on what a ref means.
Every ref is checked against the region before it is read: a wrong offset or shape raises
ValueError, never reads another tensor's bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.tensor_transport.messages import TensorRef


def tensor_view(data: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """The tensor `ref` names inside `data` (a region's bytes: uint8, 1-D), as a view: no copy.
    One as_strided over the region seen as the ref's dtype where the region's size allows it
    (a slice, a dtype view and a shape view cost ~3x as much per transfer), else through a slice."""
    check_fits(ref, data.numel())
    dtype = ref.torch_dtype
    itemsize = dtype.itemsize
    if data.numel() % itemsize == 0:  # check_fits made the offset a multiple of the itemsize
        strides = ref.strides if ref.strides is not None else _contiguous_strides(ref.shape)
        return data.view(dtype).as_strided(ref.shape, strides, ref.offset_bytes // itemsize)
    window = data[ref.offset_bytes : ref.offset_bytes + ref.span_bytes].view(dtype)
    if ref.strides is None:
        return window.view(ref.shape)
    return window.as_strided(ref.shape, ref.strides)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def check_fits(ref: TensorRef, region_num_bytes: int) -> None:
    itemsize = ref.torch_dtype.itemsize
    if ref.offset_bytes < 0 or ref.offset_bytes % itemsize:
        raise ValueError(f"offset {ref.offset_bytes} is not a multiple of {ref.dtype}'s {itemsize} bytes")
    if any(size < 0 for size in ref.shape):
        raise ValueError(f"shape {ref.shape} has a negative size")
    if ref.strides is not None and (len(ref.strides) != len(ref.shape) or any(s < 0 for s in ref.strides)):
        raise ValueError(f"strides {ref.strides} do not fit shape {ref.shape} (one non-negative stride per dim)")
    if ref.offset_bytes + ref.span_bytes > region_num_bytes:
        raise ValueError(
            f"{ref.dtype}{list(ref.shape)} at offset {ref.offset_bytes} spans {ref.span_bytes} bytes, "
            f"past the end of region {ref.region_id} ({region_num_bytes} bytes)"
        )


def to_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's elements in row-major order (any device, any strides)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor holding `data` (written by to_bytes). Copied through numpy: a tensor over
    the immutable bytes themselves would be writable memory torch must not write."""
    out = torch.empty(shape, dtype=dtype)
    expected = out.numel() * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{len(data)} inline bytes for {dtype}{list(shape)}, which needs {expected}")
    if expected:
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out

"""The transport's two messages: RegionOffer (once per region and consumer, at connection time)
and TensorRef (once per tensor sent: where it lies in an offered region).

Both are small frozen dataclasses that pickle in a few µs, so they cross our pipes as they are;
if they ever cross gRPC, they map field for field onto a proto (docs/transport.md proposes one).
A dtype travels as its name ("bfloat16"), never as a pickled torch object, so the wire form does
not depend on torch's pickling.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class TransportPath(str, enum.Enum):
    """How a region's bytes reach a consumer (negotiation.choose_path picks one per connection)."""

    CUDA_IPC = "cuda_ipc"  # the consumer maps the producer's GPU memory (same GPU, or peer access)
    SHM = "shm"  # the consumer maps the producer's POSIX shared-memory segment (same host)
    INLINE = "inline"  # every message carries its tensor's bytes (any two peers)


# The dtypes a TensorRef may name, by their wire names. float8: the fp8 KV cache.
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The wire name of `dtype` (a torch dtype or its name), checked."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot cross the transport (one of: {', '.join(DTYPES)})")
    return name


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor inside a region: `shape` elements of `dtype` starting `offset_bytes` into the
    region, laid out by `strides` (in elements; None: contiguous). A strided ref names a piece
    of a larger layout without copying it, e.g. one block of a KV pool whose blocks are not
    contiguous ([2, layers, blocks, ...]: a block is one index of dim 2 across every layer).

    On the inline path the message also carries the tensor's bytes (`inline_bytes`, contiguous
    in `shape`); on the others it carries nothing but these numbers."""

    region_id: str
    offset_bytes: int
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None = None
    inline_bytes: bytes | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[dtype_name(self.dtype)]

    @property
    def num_elements(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def num_bytes(self) -> int:
        """The tensor's own bytes (what a copy moves), not the span its strides cover."""
        return self.num_elements * self.torch_dtype.itemsize

    @property
    def span_bytes(self) -> int:
        """Bytes of the region from offset_bytes to the last element, inclusive."""
        if self.num_elements == 0:
            return 0
        if self.strides is None:
            return self.num_bytes
        last = sum((size - 1) * stride for size, stride in zip(self.shape, self.strides, strict=True))
        return (last + 1) * self.torch_dtype.itemsize


@dataclass(frozen=True, slots=True)
class RegionOffer:
    """What a consumer needs to map one region, sent once when it connects. The path was chosen
    for this producer and this consumer; the fields of the other paths stay empty."""

    region_id: str
    path: TransportPath
    num_bytes: int
    shm_name: str = ""  # SHM: the segment's name in /dev/shm
    # CUDA_IPC: torch's own export of the region's storage (torch.multiprocessing.reductions:
    # the cudaIpcMemHandle, the storage's offset in its allocation, the reference counter the
    # consumer holds, the event that orders its first read), taken as torch gives it.
    cuda_export: tuple = ()
    device_uuid: str = ""  # CUDA_IPC: the GPU the region is on (the consumer's index for it may differ)
    event_handle: bytes = b""  # CUDA_IPC: the region's interprocess event (TensorProducer.mark_written)

"""CUDA IPC through torch's own export (torch.multiprocessing.reductions), the supported way.

Producer: `export_storage(data)` runs torch's `reduce_tensor` on the region's tensor: a
cudaIpcMemHandle of the allocation that holds it (torch's caching allocator may hand out part of
a larger cudaMalloc block: the export names the block and the storage's offset in it), a
reference counter in a small shared-memory file (/dev/shm/torch_<pid>_<n>) that keeps the memory
allocated while the consumer holds it, and an event that orders the consumer's first read after
the producer's writes. One export per consumer: each holds one reference of its own, which
the producer gives back for it (`release_reference`) if the consumer died holding it.

Consumer: `open_export(export, device_index)` rebuilds the tensor (cudaIpcOpenMemHandle: slow,
hundreds of ms the first time, so it is done once per region, at connection time). The rebuilt
tensor is the mapping: dropping it closes the handle and gives the reference back.

Per transfer, ordering is one interprocess event per region (`RegionEvent`): the producer
records it after writing (TensorProducer.mark_written), the consumer's stream waits on it
before reading. Recording again before a consumer waited is safe: it then waits for later work,
which completes after the earlier.
"""

from __future__ import annotations

import inspect
import struct
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

# Bound by name, not by position, so that torch reordering its arguments cannot misplace them.
_REBUILD_SIGNATURE = inspect.signature(rebuild_cuda_tensor)


@dataclass(frozen=True, slots=True)
class CudaExport:
    args: tuple  # rebuild_cuda_tensor's arguments, as reduce_tensor gave them

    @property
    def ref_counter_name(self) -> str:
        """The /dev/shm file of the reference counter (torch's), for the reaper."""
        return self._argument("ref_counter_handle").decode().lstrip("/")

    def _argument(self, name: str):
        return _REBUILD_SIGNATURE.bind(*self.args).arguments[name]


def export_storage(data: torch.Tensor) -> CudaExport:
    rebuild, args = reduce_tensor(data)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"not a CUDA tensor: {data.device}")
    return CudaExport(tuple(args))


def open_export(export: CudaExport, device_index: int) -> torch.Tensor:
    """The producer's tensor, mapped into this process on its device `device_index` (this
    process's index of the producer's device, which the producer's index need not equal)."""
    bound = _REBUILD_SIGNATURE.bind(*export.args)
    bound.arguments["storage_device"] = device_index
    with torch.cuda.device(device_index):
        return rebuild_cuda_tensor(*bound.args)


def release_reference(export: CudaExport) -> None:
    """Give back the reference `export` gave its consumer, if the consumer did not (it died
    holding it). Only once the consumer is gone (closed or dead): the memory may then be freed.
    A consumer that closed its mapping gave its reference back itself; releasing it again took
    the counter to -1, which torch reads as unsigned, so the region stayed in its limbo forever
    (64 MiB held after free in the H200 test)."""
    if references_held(export) <= 0:
        return
    bound = _REBUILD_SIGNATURE.bind(*export.args).arguments
    torch.UntypedStorage._release_ipc_counter_cuda(bound["ref_counter_handle"], bound["ref_counter_offset"])


# torch maps its counter files with RefcountedMapAllocator: a header of 64 bytes (its alignment),
# then one int64 per exported storage.
_COUNTER_FILE_HEADER_BYTES = 64


def references_held(export: CudaExport) -> int:
    """How many references to `export`'s storage its consumers hold: 1 from the export until the
    consumer's mapping of it is dropped, 0 after."""
    offset = _REBUILD_SIGNATURE.bind(*export.args).arguments["ref_counter_offset"]
    with open(f"/dev/shm/{export.ref_counter_name}", "rb") as counters:
        counters.seek(_COUNTER_FILE_HEADER_BYTES + 8 * offset)
        return struct.unpack("q", counters.read(8))[0]


class RegionEvent:
    """The interprocess event that orders a region's reads after its writes."""

    def __init__(self, event: torch.cuda.Event, device_index: int):
        self._event = event
        self._device_index = device_index

    @classmethod
    def create(cls, device_index: int) -> RegionEvent:
        with torch.cuda.device(device_index):
            event = torch.cuda.Event(interprocess=True)
            event.record()  # recorded once, so a consumer's wait is valid before any write
        return cls(event, device_index)

    @classmethod
    def open(cls, handle: bytes, device_index: int) -> RegionEvent:
        return cls(torch.cuda.Event.from_ipc_handle(device_index, handle), device_index)

    @property
    def handle(self) -> bytes:
        return self._event.ipc_handle()

    def record(self) -> None:
        """Producer: after the writes queued on the current stream."""
        self._event.record(torch.cuda.current_stream(self._device_index))

    def wait(self) -> None:
        """Consumer: the current stream's later work waits for the producer's recorded writes."""
        torch.cuda.current_stream(self._device_index).wait_event(self._event)

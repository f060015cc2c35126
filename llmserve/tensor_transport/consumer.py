"""TensorConsumer: maps a producer's regions once, at connection time, then reads TensorRefs.

    consumer = TensorConsumer()
    consumer.open(offer)              # once per region: opening a CUDA IPC handle takes ~100s of ms
    tensor = consumer.view(ref)       # per message: a view into the mapping (inline: a new tensor)
    consumer.copy_into(ref, out)      # or a copy into memory of our own
    consumer.close(offer.region_id)   # drop the mapping (a CUDA one gives the producer's reference back)

A view is valid while the producer leaves those bytes alone (the protocol above says until when:
an acknowledgement, a KV block pinned): copy out what must outlive that. On CUDA, `view` orders
the current stream after the producer's last mark_written, and `copy_into` is queued on the
current stream: synchronize it before telling the producer it may reuse the bytes.

The consumer never creates or unlinks anything in /dev/shm and registers with no tracker: if it
dies, the kernel drops its mappings and the driver its IPC handles, and nothing is left behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.tensor_transport.cuda_ipc import CudaExport, RegionEvent, open_export
from llmserve.tensor_transport.identity import cuda_device_index
from llmserve.tensor_transport.messages import RegionOffer, TensorRef, TransportPath
from llmserve.tensor_transport.metrics import record_region_opened, record_transfer
from llmserve.tensor_transport.shm_segment import ShmSegment
from llmserve.tensor_transport.views import from_bytes, tensor_view


@dataclass(slots=True)
class _Mapping:
    path: TransportPath
    data: torch.Tensor | None  # the region's bytes, mapped here (None on the inline path)
    event: RegionEvent | None = None  # CUDA: the producer's writes to wait for


class TensorConsumer:
    """Used from one thread."""

    def __init__(self) -> None:
        self._mappings: dict[str, _Mapping] = {}
        self.num_regions_opened = 0

    def open(self, offer: RegionOffer) -> None:
        """Map `offer`'s region; a region already open stays as it is (one mapping per region)."""
        if offer.region_id in self._mappings:
            return
        self._mappings[offer.region_id] = _map(offer)
        self.num_regions_opened += 1
        record_region_opened(offer.path)

    def view(self, ref: TensorRef, num_bytes_read: int | None = None) -> torch.Tensor:
        """`num_bytes_read`: what will be read of the view, for the transfer metrics, when not
        all of it (a KV pull views the source's whole pool to gather some blocks)."""
        if ref.inline_bytes is not None:
            tensor = from_bytes(ref.inline_bytes, ref.shape, ref.torch_dtype)
            record_transfer(TransportPath.INLINE, ref.num_bytes)
            return tensor
        mapping = self._mappings.get(ref.region_id)
        if mapping is None or mapping.data is None:
            raise KeyError(f"region {ref.region_id} is not mapped here: open its offer first")
        if mapping.event is not None:
            mapping.event.wait()
        tensor = tensor_view(mapping.data, ref)
        record_transfer(mapping.path, ref.num_bytes if num_bytes_read is None else num_bytes_read)
        return tensor

    def copy_into(self, ref: TensorRef, out: torch.Tensor) -> None:
        out.copy_(self.view(ref), non_blocking=True)

    def close(self, region_id: str) -> None:
        self._mappings.pop(region_id, None)

    def close_all(self) -> None:
        self._mappings.clear()


def _map(offer: RegionOffer) -> _Mapping:
    if offer.path is TransportPath.SHM:
        return _Mapping(offer.path, ShmSegment.attach(offer.shm_name, offer.num_bytes).data)
    if offer.path is TransportPath.CUDA_IPC:
        index = cuda_device_index(offer.device_uuid)
        data = open_export(CudaExport(offer.cuda_export), index)
        return _Mapping(offer.path, data, RegionEvent.open(offer.event_handle, index))
    return _Mapping(offer.path, None)

"""TensorProducer: regions of this process's memory that consumers in other processes map once
and then read by TensorRef.

    producer = TensorProducer(local_identity("cuda:0"))
    region = producer.allocate(num_bytes)              # shm on the CPU, device memory on CUDA
    pool = region.view(region.ref(0, shape, "bfloat16"))   # use it as any tensor (a KV pool)
    offer = producer.offer(region, consumer_identity)  # once per consumer, at connection time
    ... write into pool ...; producer.mark_written(region)
    send(producer.message_for(offer, region.ref(offset_bytes, shape, dtype, strides)))
    producer.withdraw(offer)                           # the consumer is gone (closed or dead)
    producer.close()                                   # every region freed, every segment unlinked

Lifetimes. The producer owns every region: it alone unlinks a segment (close/free, or this
process's reaper if it dies: shm_reaper.py) and frees device memory. The memory a TensorRef
names must stay unchanged until its consumer has read it; when that is, the protocol above
decides (an acknowledgement, a pinned KV block). A region must outlive its consumers' use of it: free it
after withdrawing their offers.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass

import torch

from llmserve.tensor_transport.cuda_ipc import CudaExport, RegionEvent, export_storage, release_reference
from llmserve.tensor_transport.identity import PeerIdentity, cuda_device_index
from llmserve.tensor_transport.messages import RegionOffer, TensorRef, TransportPath, dtype_name
from llmserve.tensor_transport.negotiation import choose_path
from llmserve.tensor_transport.shm_reaper import process_reaper
from llmserve.tensor_transport.shm_segment import ShmSegment
from llmserve.tensor_transport.views import check_fits, tensor_view, to_bytes


@dataclass(slots=True)
class Region:
    """One exported allocation. `data` is all of it as bytes (uint8, 1-D); the producer uses it
    through views (`view(ref(...))`), and consumers address it by offset."""

    region_id: str
    data: torch.Tensor
    segment: ShmSegment | None = None  # host regions: the shared-memory segment under `data`
    event: RegionEvent | None = None  # CUDA regions: orders consumers' reads after writes

    @property
    def num_bytes(self) -> int:
        return self.data.numel()

    def ref(
        self, offset_bytes: int, shape: tuple[int, ...], dtype: torch.dtype | str, strides: tuple[int, ...] | None = None
    ) -> TensorRef:
        strides = tuple(strides) if strides is not None else None
        return TensorRef(self.region_id, offset_bytes, tuple(shape), dtype_name(dtype), strides)

    def ref_of(self, tensor: torch.Tensor) -> TensorRef:
        """The ref of `tensor`, a view into this region (a KV pool's block: `pool[:, :, i:i+1]`)."""
        offset_bytes = tensor.data_ptr() - self.data.data_ptr()
        if tensor.device != self.data.device or offset_bytes < 0:
            raise ValueError(f"the tensor is not a view into region {self.region_id}")
        ref = self.ref(offset_bytes, tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()))
        check_fits(ref, self.num_bytes)
        return ref

    def view(self, ref: TensorRef) -> torch.Tensor:
        return tensor_view(self.data, ref)


class TensorProducer:
    """Used from one thread."""

    def __init__(self, identity: PeerIdentity):
        self.identity = identity
        self._producer_id = f"{identity.hostname}/{os.getpid()}/{secrets.token_hex(4)}"
        self._device_index = cuda_device_index(identity.device_uuid) if identity.is_cuda else None
        self._regions: dict[str, Region] = {}
        self._num_allocated = 0
        # CUDA offers not yet withdrawn, each holding one reference for its consumer.
        self._cuda_offers: dict[RegionOffer, CudaExport] = {}

    def allocate(self, num_bytes: int) -> Region:
        """A new zero-filled region on this producer's device."""
        region_id = f"{self._producer_id}/{self._num_allocated}"
        self._num_allocated += 1
        if self._device_index is None:
            segment = ShmSegment.create(num_bytes, process_reaper())
            region = Region(region_id, segment.data, segment=segment)
        else:
            data = torch.zeros(num_bytes, dtype=torch.uint8, device=f"cuda:{self._device_index}")
            region = Region(region_id, data, event=RegionEvent.create(self._device_index))
        self._regions[region_id] = region
        return region

    def offer(self, region: Region, consumer: PeerIdentity) -> RegionOffer:
        """What `consumer` needs to map `region`, by the path their identities allow."""
        path = choose_path(self.identity, consumer)
        if path is TransportPath.SHM:
            return RegionOffer(region.region_id, path, region.num_bytes, shm_name=region.segment.name)
        if path is TransportPath.CUDA_IPC:
            return self._offer_cuda(region)
        return RegionOffer(region.region_id, path, region.num_bytes)

    def _offer_cuda(self, region: Region) -> RegionOffer:
        export = export_storage(region.data)
        # torch's reference-counter file would outlive a producer killed now: the reaper has it.
        process_reaper().register(export.ref_counter_name)
        offer = RegionOffer(
            region.region_id, TransportPath.CUDA_IPC, region.num_bytes,
            cuda_export=export.args, device_uuid=self.identity.device_uuid, event_handle=region.event.handle,
        )
        self._cuda_offers[offer] = export
        return offer

    def withdraw(self, offer: RegionOffer) -> None:
        """`offer`'s consumer is gone (closed its mapping, or died holding it): give back the
        reference it held, so the region's memory is freed when the region is."""
        export = self._cuda_offers.pop(offer, None)
        if export is not None:
            release_reference(export)

    def message_for(self, offer: RegionOffer, ref: TensorRef) -> TensorRef:
        """What to send `offer`'s consumer for `ref`: the ref itself, or on the inline path the
        ref with its bytes."""
        if ref.region_id != offer.region_id:
            raise ValueError(f"ref names region {ref.region_id}, the offer is for {offer.region_id}")
        if offer.path is not TransportPath.INLINE:
            return ref
        return dataclasses.replace(ref, inline_bytes=to_bytes(self._regions[ref.region_id].view(ref)))

    def mark_written(self, region: Region) -> None:
        """After writing into `region` on the current stream: consumers' reads wait for those
        writes (CUDA). Host regions need nothing: the message's send orders them."""
        if region.event is not None:
            region.event.record()

    def free(self, region: Region) -> None:
        """Unlink its segment and let go of its memory (freed once the caller's own views of it
        are gone too); withdraws its offers first."""
        for offer in [offer for offer in self._cuda_offers if offer.region_id == region.region_id]:
            self.withdraw(offer)
        if region.segment is not None:
            region.segment.unlink()
        self._regions.pop(region.region_id, None)

    def close(self) -> None:
        for region in list(self._regions.values()):
            self.free(region)
        if self._device_index is not None:
            torch.cuda.ipc_collect()  # memory whose consumers let go while we still held it

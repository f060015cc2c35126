"""The KV pool as a transport region, so co-located replicas can read its blocks (issue 22,
KV pull; docs/transport.md).

With --kv-pull the pool tensor ([2, layers, blocks, block_size, kv_heads, head_dim], kv_cache.py)
is allocated inside one region of a TensorProducer: a /dev/shm segment on CPU, device memory
exported by CUDA IPC on a GPU. A replica's pool is then its region id, and a block of it is
(region, block id): its bytes lie at `block_id × block_bytes_per_layer_slice` in every layer, at
the pool's strides, which `KvPoolLayout` lets the puller compute without asking.

The exporting replica keeps one offer per consumer identity (an offer on the CUDA path holds a
reference of its own, so it is not made again for every pull). Blocks are read while the
source pins them (BlockManager.hold), so they are not reused under the reader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.tensor_transport import PeerIdentity, RegionOffer, TensorProducer, TensorRef, local_identity
from llmserve.tensor_transport.messages import DTYPES, dtype_name


@dataclass(frozen=True, slots=True)
class KvPoolLayout:
    """The shape of a replica's KV pool: two replicas can exchange blocks when all but
    num_blocks are equal (the same model, block size and KV dtype)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the transport's dtype name: "bfloat16", "float8_e4m3fn"

    @classmethod
    def of(cls, pool: torch.Tensor) -> KvPoolLayout:
        _, num_layers, num_blocks, block_size, num_kv_heads, head_dim = pool.shape
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype_name(pool.dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def can_exchange_with(self, other: KvPoolLayout) -> bool:
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype) == (
            other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.dtype
        )

    def block_run_ref(self, region_id: str, first_block_id: int, num_blocks: int) -> TensorRef:
        """The ref of blocks first_block_id .. + num_blocks - 1 of a pool laid out like this one
        (contiguous in the region from offset 0): pool[:, :, first:first + num_blocks]."""
        if not (0 <= first_block_id and first_block_id + num_blocks <= self.num_blocks):
            raise ValueError(f"blocks {first_block_id}..+{num_blocks} are outside a pool of {self.num_blocks}")
        _, layers, blocks, block_size, heads, head_dim = self.shape
        block_elements = block_size * heads * head_dim
        strides = (layers * blocks * block_elements, blocks * block_elements, block_elements, heads * head_dim, head_dim, 1)
        offset_bytes = first_block_id * block_elements * self.torch_dtype.itemsize
        shape = (2, layers, num_blocks, block_size, heads, head_dim)
        return TensorRef(region_id, offset_bytes, shape, self.dtype, strides)


class KvPoolExport:
    """The producer side of a replica's pool: allocates it in a region and offers that region
    to pullers. Used from the engine core's thread."""

    def __init__(self, device: torch.device):
        self._producer = TensorProducer(local_identity(device))
        self._region = None
        self._offers: dict[PeerIdentity, RegionOffer] = {}

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool: zero-filled (padded attention reads must be finite, kv_cache.py)."""
        assert self._region is None, "one pool per replica"
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        self._region = self._producer.allocate(num_bytes)
        return self._region.view(self._region.ref(0, shape, dtype))

    @property
    def region_id(self) -> str:
        return self._region.region_id

    def offer(self, consumer: PeerIdentity) -> RegionOffer:
        """What `consumer` maps the pool with (the path their identities allow); made once per
        consumer identity."""
        offer = self._offers.get(consumer)
        if offer is None:
            offer = self._offers[consumer] = self._producer.offer(self._region, consumer)
        return offer

    def mark_written(self) -> None:
        """Readers' copies wait for every write queued so far (CUDA; a no-op on host memory):
        a block registered in the prefix cache may still be computed by a launched step."""
        self._producer.mark_written(self._region)

    def close(self) -> None:
        """Unlink the segment (its memory goes with the last mapping of it)."""
        self._offers.clear()
        self._producer.close()

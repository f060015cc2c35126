"""KV pull's messages between protobuf and the engine's types (issue 22; docs/transport.md):
a peer's identity, a region offer (CUDA IPC export included) and a pin's answer.

Protobuf stops here: the engine sees PeerIdentity, RegionOffer and KvPullSource only. torch's
CUDA IPC export is a tuple of rebuild_cuda_tensor's arguments; it crosses as CudaIpcExport,
field for field by argument name, its two classes by qualified name from a short list (never
pickled: a peer's bytes must not name what we import).
"""

from __future__ import annotations

import inspect

import torch

from llmserve.inference.engine.kv_block_import import KvPullSource
from llmserve.inference.engine.kv_pool_export import KvPoolLayout
from llmserve.tensor_transport import PeerIdentity, RegionOffer, TransportPath
from llmserve.tensor_transport.messages import DTYPES, dtype_name
from llmserve.v1 import inference_pb2

_PATHS = {
    TransportPath.CUDA_IPC: inference_pb2.TRANSPORT_PATH_CUDA_IPC,
    TransportPath.SHM: inference_pb2.TRANSPORT_PATH_SHM,
    TransportPath.INLINE: inference_pb2.TRANSPORT_PATH_INLINE,
}
_PATHS_FROM_PB = {value: path for path, value in _PATHS.items()}
# The classes reduce_tensor names for a plain tensor's storage, by the name they cross as.
_CLASSES = {f"{cls.__module__}.{cls.__qualname__}": cls for cls in (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)}
# rebuild_cuda_tensor's arguments that CudaIpcExport carries as they are (bytes, ints, a bool).
_PLAIN_ARGUMENTS = (
    "tensor_offset", "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
    "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required",
)


def identity_to_pb(identity: PeerIdentity) -> inference_pb2.PeerIdentity:
    return inference_pb2.PeerIdentity(
        boot_id=identity.boot_id, hostname=identity.hostname, shm_device=identity.shm_device,
        ipc_namespace=identity.ipc_namespace, device_uuid=identity.device_uuid,
        readable_device_uuids=list(identity.readable_device_uuids),
    )


def identity_from_pb(pb: inference_pb2.PeerIdentity) -> PeerIdentity:
    return PeerIdentity(
        boot_id=pb.boot_id, hostname=pb.hostname, shm_device=pb.shm_device, ipc_namespace=pb.ipc_namespace,
        device_uuid=pb.device_uuid, readable_device_uuids=tuple(pb.readable_device_uuids),
    )


def pin_to_pb(pin_id: str, source: KvPullSource, lease_ms: int) -> inference_pb2.PinKvBlocksResponse:
    layout = source.layout
    return inference_pb2.PinKvBlocksResponse(
        pin_id=pin_id,
        block_ids=list(source.block_ids),
        layout=inference_pb2.KvPoolLayout(
            num_layers=layout.num_layers, num_blocks=layout.num_blocks, block_size_tokens=layout.block_size,
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
        ),
        region=offer_to_pb(source.offer),
        lease_ms=lease_ms,
    )


def pin_from_pb(pb: inference_pb2.PinKvBlocksResponse) -> KvPullSource:
    """Raises ValueError on an answer that cannot describe a pool (a dtype we do not know)."""
    layout = pb.layout
    return KvPullSource(
        offer=offer_from_pb(pb.region),
        layout=KvPoolLayout(
            layout.num_layers, layout.num_blocks, layout.block_size_tokens, layout.num_kv_heads, layout.head_dim,
            dtype_name(layout.dtype),
        ),
        block_ids=tuple(pb.block_ids),
    )


def offer_to_pb(offer: RegionOffer) -> inference_pb2.RegionOffer:
    pb = inference_pb2.RegionOffer(
        region_id=offer.region_id, path=_PATHS[offer.path], num_bytes=offer.num_bytes, shm_name=offer.shm_name,
        device_uuid=offer.device_uuid, event_handle=offer.event_handle,
    )
    if offer.cuda_export:
        pb.cuda_export.CopyFrom(cuda_export_to_pb(offer.cuda_export))
    return pb


def offer_from_pb(pb: inference_pb2.RegionOffer) -> RegionOffer:
    if pb.path not in _PATHS_FROM_PB:
        raise ValueError(f"region offer with no transport path ({pb.path})")
    return RegionOffer(
        region_id=pb.region_id, path=_PATHS_FROM_PB[pb.path], num_bytes=pb.num_bytes, shm_name=pb.shm_name,
        cuda_export=cuda_export_from_pb(pb.cuda_export) if pb.HasField("cuda_export") else (),
        device_uuid=pb.device_uuid, event_handle=pb.event_handle,
    )


def cuda_export_to_pb(args: tuple) -> inference_pb2.CudaIpcExport:
    bound = _rebuild_signature().bind(*args).arguments
    if bound["tensor_cls"] is not torch.Tensor or bound["requires_grad"]:
        raise ValueError("a region's export is of a plain tensor without grad")
    return inference_pb2.CudaIpcExport(
        tensor_size=list(bound["tensor_size"]), tensor_stride=list(bound["tensor_stride"]),
        storage_class=_class_name(bound["storage_cls"]), dtype=dtype_name(bound["dtype"]),
        **{name: bound[name] for name in _PLAIN_ARGUMENTS},
    )


def cuda_export_from_pb(pb: inference_pb2.CudaIpcExport) -> tuple:
    if pb.storage_class not in _CLASSES:
        raise ValueError(f"storage class {pb.storage_class!r} is not one a region is exported with")
    arguments = dict(
        tensor_cls=torch.Tensor, tensor_size=torch.Size(pb.tensor_size), tensor_stride=tuple(pb.tensor_stride),
        storage_cls=_CLASSES[pb.storage_class], dtype=DTYPES[dtype_name(pb.dtype)], requires_grad=False,
        **{name: getattr(pb, name) for name in _PLAIN_ARGUMENTS},
    )
    return tuple(_rebuild_signature().bind(**arguments).args)


def _class_name(cls: type) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name not in _CLASSES:
        raise ValueError(f"storage class {name} is not one a region is exported with")
    return name


def _rebuild_signature() -> inspect.Signature:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return inspect.signature(rebuild_cuda_tensor)

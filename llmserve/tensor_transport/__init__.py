"""The tensor transport: tensors between our processes without serializing them (issue 22,
docs/transport.md).

A producer exports a region of its memory once (a POSIX shared-memory segment for host memory,
a CUDA IPC handle for device memory); a consumer maps it once, when it connects; each message
then carries only where a tensor lies in the region (TensorRef: region id, offset, shape, dtype,
optional strides). Peers negotiate the path from their identities (same GPU or peer access →
CUDA IPC; same host and /dev/shm → shm; otherwise the bytes travel inline), and every transfer
is counted by path (`llmserve_transport_transfers_total{path}`).

    identity.py     PeerIdentity: boot id, /dev/shm, IPC namespace, device UUID
    negotiation.py  choose_path(producer, consumer) → TransportPath
    messages.py     TensorRef, RegionOffer, TransportPath (the wire)
    producer.py     TensorProducer, Region: allocate, offer, message_for, withdraw, free
    consumer.py     TensorConsumer: open once, view / copy_into per message
    views.py        what a TensorRef names in a region's bytes (both sides)
    shm_segment.py  ShmSegment: a /dev/shm segment, created and unlinked by its producer only
    shm_reaper.py   the process that unlinks a dead producer's segments
    cuda_ipc.py     torch's CUDA IPC export and the per-region interprocess event
    metrics.py      llmserve_transport_* counters
"""

import importlib

# Imported on first use (PEP 562): the CPU-only services import identity.py and shm_reaper.py
# (the prompt ids ring, llmserve.prompt_ids_region), which need no torch; these do.
_EXPORTS = {
    "TensorConsumer": "consumer", "PeerIdentity": "identity", "local_identity": "identity",
    "RegionOffer": "messages", "TensorRef": "messages", "TransportPath": "messages",
    "choose_path": "negotiation", "Region": "producer", "TensorProducer": "producer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

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

from llmserve.tensor_transport.consumer import TensorConsumer
from llmserve.tensor_transport.identity import PeerIdentity, local_identity
from llmserve.tensor_transport.messages import RegionOffer, TensorRef, TransportPath
from llmserve.tensor_transport.negotiation import choose_path
from llmserve.tensor_transport.producer import Region, TensorProducer

__all__ = [
    "PeerIdentity", "Region", "RegionOffer", "TensorConsumer", "TensorProducer", "TensorRef",
    "TransportPath", "choose_path", "local_identity",
]

"""choose_path: which transport a producer's region takes to a consumer, from their identities.

    same host, producer on CUDA, consumer on a CUDA device that can read it, one IPC namespace
        → CUDA_IPC (the consumer maps the producer's GPU memory)
    same host, producer on the CPU, one /dev/shm → SHM (the consumer maps the segment)
    anything else → INLINE (each message carries its bytes)

A producer on CUDA that the consumer cannot map goes inline, not through shared memory: staging
through the host is a copy the producer would pay per message, and it is what inline costs
already. The choice is counted per transfer by path (metrics.py), so a fallback to inline
where a mapping was expected is visible, never silent.
"""

from __future__ import annotations

from llmserve.tensor_transport.identity import PeerIdentity
from llmserve.tensor_transport.messages import TransportPath


def choose_path(producer: PeerIdentity, consumer: PeerIdentity) -> TransportPath:
    if not is_same_host(producer, consumer):
        return TransportPath.INLINE
    if producer.is_cuda:
        return TransportPath.CUDA_IPC if can_map_cuda(producer, consumer) else TransportPath.INLINE
    if _shares(producer.shm_device, consumer.shm_device):
        return TransportPath.SHM
    return TransportPath.INLINE


def is_same_host(a: PeerIdentity, b: PeerIdentity) -> bool:
    return _shares(a.boot_id, b.boot_id)


def can_map_cuda(producer: PeerIdentity, consumer: PeerIdentity) -> bool:
    """The consumer can open an IPC handle of memory on the producer's device."""
    return (
        consumer.is_cuda
        and _shares(producer.ipc_namespace, consumer.ipc_namespace)
        and producer.device_uuid in consumer.readable_device_uuids
    )


def _shares(a: str | int, b: str | int) -> bool:
    """Equal and known: an empty or zero value (unreadable) matches nothing."""
    return bool(a) and a == b

"""KV cache events: how a replica tells the routing index which prefix blocks it holds.

The typed form of InferenceService.WatchKvEvents (inference.proto), shared by the producer
(the inference replica's event log) and the consumers (the prefix index, in memory or in Redis).
A block is named by its chained hash (llmserve.block_hash), so an index entry "hash h is on
replica r" means r holds the KV of the whole prefix that ends with that block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from llmserve.v1 import inference_pb2


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive blocks of one prefix entered the cache; parent None: the first starts a prompt."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    block_size_tokens: int


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


KvEvent = Union[BlocksStored, BlocksRemoved, AllCleared]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """The cheap load signal routing weighs against cached blocks."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One message of WatchKvEvents; `events` empty: a heartbeat."""

    replica_id: str
    incarnation: str
    sequence_number: int
    events: tuple[KvEvent, ...] = ()
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    heartbeat_ttl_ms: int = 0

    @property
    def is_snapshot(self) -> bool:
        """A batch that starts with AllCleared replaces everything held of the replica."""
        return bool(self.events) and isinstance(self.events[0], AllCleared)


def event_to_pb(event: KvEvent) -> inference_pb2.KvEvent:
    if isinstance(event, BlocksStored):
        stored = inference_pb2.KvBlocksStored(
            block_hashes=event.block_hashes, block_size_tokens=event.block_size_tokens
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return inference_pb2.KvEvent(stored=stored)
    if isinstance(event, BlocksRemoved):
        return inference_pb2.KvEvent(removed=inference_pb2.KvBlocksRemoved(block_hashes=event.block_hashes))
    return inference_pb2.KvEvent(cleared=inference_pb2.KvAllCleared())


def event_from_pb(message: inference_pb2.KvEvent) -> KvEvent:
    kind = message.WhichOneof("kind")
    if kind == "stored":
        stored = message.stored
        parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
        return BlocksStored(tuple(stored.block_hashes), parent, stored.block_size_tokens)
    if kind == "removed":
        return BlocksRemoved(tuple(message.removed.block_hashes))
    if kind == "cleared":
        return AllCleared()
    raise ValueError("KvEvent has no kind set")


def batch_to_pb(batch: KvEventBatch) -> inference_pb2.WatchKvEventsResponse:
    load = batch.load
    return inference_pb2.WatchKvEventsResponse(
        replica_id=batch.replica_id,
        incarnation=batch.incarnation,
        sequence_number=batch.sequence_number,
        events=[event_to_pb(event) for event in batch.events],
        load=inference_pb2.GetLoadResponse(
            replica_id=batch.replica_id,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
        ),
        heartbeat_ttl_ms=batch.heartbeat_ttl_ms,
    )


def batch_from_pb(message: inference_pb2.WatchKvEventsResponse) -> KvEventBatch:
    load = message.load
    return KvEventBatch(
        replica_id=message.replica_id,
        incarnation=message.incarnation,
        sequence_number=message.sequence_number,
        events=tuple(event_from_pb(event) for event in message.events),
        load=ReplicaLoad(load.num_running, load.num_waiting, load.kv_blocks_used, load.kv_blocks_total),
        heartbeat_ttl_ms=message.heartbeat_ttl_ms,
    )

"""MemoryPrefixIndex: the routing index in one process's memory (the embedded default).

Two maps kept in step: block hash → replicas holding it (for lookups) and replica → its
hashes (to drop a replica at once). Both hold only what replicas reported as cached and not
yet removed, so memory is bounded by the replicas' KV pools (about 100 bytes per cached
block per replica).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from llmserve.kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEvent, KvEventBatch
from llmserve.prefix_index.interface import ApplyOutcome, PrefixMatches, continues


@dataclass(slots=True)
class _ReplicaEntries:
    incarnation: str
    sequence_number: int
    block_hashes: set[int] = field(default_factory=set)


class MemoryPrefixIndex:
    def __init__(self) -> None:
        self._replicas_by_hash: dict[int, set[str]] = {}
        self._replicas: dict[str, _ReplicaEntries] = {}

    async def apply(self, batch: KvEventBatch) -> ApplyOutcome:
        replica = self._replicas.get(batch.replica_id)
        if batch.is_snapshot:
            self._drop(batch.replica_id)
            replica = self._replicas[batch.replica_id] = _ReplicaEntries(batch.incarnation, batch.sequence_number)
        elif replica is None or not continues(replica.incarnation, replica.sequence_number, batch):
            self._drop(batch.replica_id)
            return ApplyOutcome.RESYNC
        for event in batch.events:
            self._apply_event(batch.replica_id, replica, event)
        replica.sequence_number = batch.sequence_number
        return ApplyOutcome.APPLIED

    async def lookup(self, block_hashes: Sequence[int]) -> PrefixMatches:
        matches: dict[str, int] = {}
        holders: set[str] | None = None
        for position, block_hash in enumerate(block_hashes, start=1):
            found = self._replicas_by_hash.get(block_hash)
            if not found:
                break
            holders = set(found) if holders is None else holders & found
            if not holders:
                break
            for replica_id in holders:
                matches[replica_id] = position
        return matches

    async def remove_replica(self, replica_id: str) -> None:
        self._drop(replica_id)

    def _drop(self, replica_id: str) -> None:
        replica = self._replicas.pop(replica_id, None)
        if replica is not None:
            self._remove_hashes(replica_id, replica, list(replica.block_hashes))

    @property
    def num_entries(self) -> int:
        """(block, replica) pairs held: what bounds this index's memory."""
        return sum(len(replica.block_hashes) for replica in self._replicas.values())

    def _apply_event(self, replica_id: str, replica: _ReplicaEntries, event: KvEvent) -> None:
        if isinstance(event, BlocksStored):
            for block_hash in event.block_hashes:
                replica.block_hashes.add(block_hash)
                self._replicas_by_hash.setdefault(block_hash, set()).add(replica_id)
        elif isinstance(event, BlocksRemoved):
            self._remove_hashes(replica_id, replica, event.block_hashes)
        elif isinstance(event, AllCleared):
            self._remove_hashes(replica_id, replica, list(replica.block_hashes))

    def _remove_hashes(self, replica_id: str, replica: _ReplicaEntries, block_hashes: Sequence[int]) -> None:
        for block_hash in block_hashes:
            replica.block_hashes.discard(block_hash)
            holders = self._replicas_by_hash.get(block_hash)
            if holders is not None:
                holders.discard(replica_id)
                if not holders:
                    del self._replicas_by_hash[block_hash]

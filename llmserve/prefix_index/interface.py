"""What both routing-index backends do: apply one replica's event batches, look a prompt up.

Rules (docs/routing.md, "Event semantics"), the same in both backends:
  - a snapshot (a batch that starts with AllCleared) replaces all the index holds of its
    replica, whatever came before;
  - any other batch must continue the replica's stream: same incarnation, sequence_number one
    more than the last batch with events (a heartbeat repeats the last number). Anything else
    means events were missed: the replica's entries are dropped and the answer is RESYNC, so
    that the consumer subscribes again and starts from a fresh snapshot;
  - a replica counts a block of a prompt only if it holds every block before it too, since a
    chained hash names the whole prefix up to its block and the engine reuses a prefix only
    from its start.
"""

from __future__ import annotations

import enum
from typing import Mapping, Protocol, Sequence

from llmserve.kv_events import KvEventBatch

# replica_id → how many leading blocks of the prompt the replica holds (only replicas with ≥ 1).
PrefixMatches = Mapping[str, int]


class ApplyOutcome(enum.Enum):
    APPLIED = "applied"
    # The batch does not continue what the index holds of its replica (a gap, a new
    # incarnation, an index that lost its state): the replica's entries were dropped;
    # subscribe again for a snapshot.
    RESYNC = "resync"


def continues(last_incarnation: str | None, last_sequence_number: int, batch: KvEventBatch) -> bool:
    """Whether a non-snapshot `batch` follows the last one applied for its replica."""
    if last_incarnation != batch.incarnation:
        return False
    expected = last_sequence_number + 1 if batch.events else last_sequence_number
    return batch.sequence_number == expected


class PrefixIndex(Protocol):
    """Asynchronous so that one router serves both backends; the in-memory one never waits."""

    async def apply(self, batch: KvEventBatch) -> ApplyOutcome: ...

    async def lookup(self, block_hashes: Sequence[int]) -> PrefixMatches:
        """Leading blocks of the chain `block_hashes` held per replica; empty when nothing is
        known (or, for Redis, when it does not answer in time)."""
        ...

    async def remove_replica(self, replica_id: str) -> None: ...

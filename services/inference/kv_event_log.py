"""KvEventLog: the replica's prefix-cache changes as numbered batches, for WatchKvEvents.

    AsyncEngine._deliver ──record(CacheEvents)──▶ mirror (block hash → parent hash)
                                                  batch N ──▶ each subscription's queue
    subscribe(load_only, heartbeat_interval_s) ──▶ snapshot (numbered N), N+1, N+2, ...,
                                                   a heartbeat after each quiet interval

subscribe() serves InferenceService.WatchKvEvents (servicer.py) and the Redis publisher
(llmserve/prefix_index/) alike. Batches are numbered 1, 2, ... per incarnation (a new uuid per
process start). Everything runs on the event loop, so record() never interleaves with a
snapshot: a snapshot numbered N holds exactly the changes of batches 1..N, and its
subscription's queue starts at N+1.

Why a mirror of the cache here: a snapshot (each new subscriber, each resubscribe after a gap)
needs no round trip to the engine core, which may be in another process, busy in a step.

A slow subscriber never holds the engine back nor grows memory without bound: its queue holds
at most `max_queued_batches` batches; one more and the subscription is cut off (its queue
dropped) and ends with SubscriberFellBehind (RESOURCE_EXHAUSTED on the RPC). The subscriber
then resubscribes and starts again from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from llmserve.errors import ResourceExhausted
from llmserve.inference.config import DEFAULT_KV_EVENTS_HEARTBEAT_MS
from llmserve.inference.engine.types import CacheEvent, EngineLoad
from llmserve.kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEvent, KvEventBatch, ReplicaLoad

if TYPE_CHECKING:
    from llmserve.inference.async_engine import AsyncEngine

log = logging.getLogger(__name__)

# A subscriber considers the replica gone after this many heartbeat intervals without a batch.
HEARTBEAT_TTL_INTERVALS = 4
# Per subscription. A batch is one engine step's changes, so this is seconds of engine steps.
DEFAULT_MAX_QUEUED_BATCHES = 4096


class SubscriberFellBehind(ResourceExhausted):
    """The subscription's queue overflowed: what it held of the replica has a gap."""

    def __init__(self, max_queued_batches: int):
        super().__init__(
            f"kv events: the subscriber fell more than {max_queued_batches} batches behind; "
            "resubscribe for a fresh snapshot",
            retry_after_ms=0,
        )


@dataclass(slots=True, eq=False)
class _Subscription:
    load_only: bool
    max_queued_batches: int
    queued: deque[KvEventBatch] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set: queued, cut off or closed
    is_cut_off: bool = False

    def offer(self, batch: KvEventBatch) -> bool:
        """Queue the batch; False (the queue dropped) when it is full."""
        self.wake.set()
        if len(self.queued) >= self.max_queued_batches:
            self.queued.clear()
            self.is_cut_off = True
            return False
        self.queued.append(batch)
        return True


class KvEventLog:
    """`replica_id` may be set once after binding, before serving (its default names the port)."""

    def __init__(
        self,
        block_size_tokens: int,
        load: Callable[[], EngineLoad],
        *,
        replica_id: str = "",
        default_heartbeat_interval_s: float = DEFAULT_KV_EVENTS_HEARTBEAT_MS / 1000,
        max_queued_batches: int = DEFAULT_MAX_QUEUED_BATCHES,
    ):
        """`load`: the engine's latest load, cheap (no call into the core)."""
        self.replica_id = replica_id
        self.incarnation = uuid.uuid4().hex
        self.default_heartbeat_interval_s = default_heartbeat_interval_s
        self._block_size_tokens = block_size_tokens
        self._load = load
        self._max_queued_batches = max_queued_batches
        # What the cache holds: block hash → hash of the block before it (None: a first block).
        self._parents: dict[int, int | None] = {}
        self._sequence_number = 0
        self._subscriptions: set[_Subscription] = set()
        self._is_closed = False

    @classmethod
    def of(cls, engine: AsyncEngine, **options) -> KvEventLog:
        """The log of `engine`'s cache, which forwards its changes here from now on."""
        event_log = cls(engine.model_info.block_size_tokens, engine.load, **options)
        engine.forward_kv_events(event_log.record)
        return event_log

    # --- the engine side --------------------------------------------------------------------

    def record(self, cache_events: list[CacheEvent]) -> None:
        """One batch: the changes applied to the mirror, numbered, queued for each subscriber."""
        events = self._apply(cache_events)
        self._sequence_number += 1
        batch = self._batch(events, heartbeat_ttl_ms=0)
        for subscription in [s for s in self._subscriptions if not s.load_only]:
            if not subscription.offer(batch):
                self._subscriptions.discard(subscription)
                log.warning("kv events: a subscriber fell %d batches behind; cut off", self._max_queued_batches)

    def close(self) -> None:
        """End every subscription (cleanly) and refuse new ones: the replica is draining."""
        self._is_closed = True
        for subscription in self._subscriptions:
            subscription.wake.set()

    # --- the subscriber side ----------------------------------------------------------------

    async def subscribe(self, load_only: bool, heartbeat_interval_s: float) -> AsyncIterator[KvEventBatch]:
        """First a snapshot (load_only: a heartbeat), then every batch recorded after it, and a
        heartbeat whenever nothing was sent for `heartbeat_interval_s`. Ends when the log
        closes; raises SubscriberFellBehind when this subscription was cut off."""
        assert heartbeat_interval_s > 0
        if self._is_closed:
            return
        ttl_ms = round(heartbeat_interval_s * 1000 * HEARTBEAT_TTL_INTERVALS)
        subscription = _Subscription(load_only, self._max_queued_batches)
        self._subscriptions.add(subscription)
        try:
            yield self._batch(() if load_only else self._snapshot_events(), ttl_ms)
            while not self._is_closed:
                if subscription.is_cut_off:
                    raise SubscriberFellBehind(self._max_queued_batches)
                if subscription.queued:
                    yield dataclasses.replace(subscription.queued.popleft(), heartbeat_ttl_ms=ttl_ms)
                    continue
                subscription.wake.clear()
                try:
                    async with asyncio.timeout(heartbeat_interval_s):
                        await subscription.wake.wait()
                except TimeoutError:
                    # A batch recorded as the timeout fired goes first: the heartbeat carries
                    # the last number recorded, which this subscriber must already have.
                    if not subscription.queued:
                        yield self._batch((), ttl_ms)
        finally:
            self._subscriptions.discard(subscription)

    # --- internals --------------------------------------------------------------------------

    def _apply(self, cache_events: list[CacheEvent]) -> tuple[KvEvent, ...]:
        """The typed events of `cache_events`, in order (consecutive removals in one event),
        applied to the mirror."""
        events: list[KvEvent] = []
        removed: list[int] = []
        for cache_event in cache_events:
            if isinstance(cache_event, int):
                removed.append(cache_event)
                self._parents.pop(cache_event, None)
                continue
            if removed:
                events.append(BlocksRemoved(tuple(removed)))
                removed = []
            parent_hash, block_hashes = cache_event
            for block_hash, parent in zip(block_hashes, [parent_hash, *block_hashes]):
                self._parents[block_hash] = parent
            events.append(BlocksStored(tuple(block_hashes), parent_hash, self._block_size_tokens))
        if removed:
            events.append(BlocksRemoved(tuple(removed)))
        return tuple(events)

    def _snapshot_events(self) -> tuple[KvEvent, ...]:
        """AllCleared, then every cached block, each after its parent (when that is cached),
        consecutive blocks of one chain in one BlocksStored."""
        runs: list[tuple[int | None, list[int]]] = []
        emitted: set[int] = set()
        for newest in self._parents:
            chain = []  # `newest` and its ancestors not emitted yet, child first
            ancestor: int | None = newest
            while ancestor in self._parents and ancestor not in emitted:
                chain.append(ancestor)
                emitted.add(ancestor)
                ancestor = self._parents[ancestor]
            for block_hash in reversed(chain):
                parent_hash = self._parents[block_hash]
                if runs and runs[-1][1][-1] == parent_hash:
                    runs[-1][1].append(block_hash)
                else:
                    runs.append((parent_hash, [block_hash]))
        stored = (BlocksStored(tuple(hashes), parent, self._block_size_tokens) for parent, hashes in runs)
        return (AllCleared(), *stored)

    def _batch(self, events: tuple[KvEvent, ...], heartbeat_ttl_ms: int) -> KvEventBatch:
        load = self._load()
        return KvEventBatch(
            replica_id=self.replica_id,
            incarnation=self.incarnation,
            sequence_number=self._sequence_number,
            events=events,
            load=ReplicaLoad(load.num_running, load.num_waiting, load.kv_blocks_used, load.kv_blocks_total),
            heartbeat_ttl_ms=heartbeat_ttl_ms,
        )

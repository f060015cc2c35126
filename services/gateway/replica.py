"""Replica: one inference replica as the router sees it — its client, liveness and load.

Load is counted in requests: the gateway's own in-flight requests on the replica (instant,
exact) plus everyone else's as the replica's last batch reported them: running + waiting then,
less the most of ours in flight since the batch before (a batch is sent as the step that
finishes a request ends, so it may still count a request whose end this gateway has already
seen: subtracting only what is in flight when it arrives would leave phantom load behind). With
one gateway the second term is about 0; with several it is as fresh as the batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Iterator

from llmserve.gateway.inference_client import InferenceClient
from llmserve.gateway.metrics import record_replica_liveness
from llmserve.kv_events import KvEventBatch, ReplicaLoad
from llmserve.prefix_index.redis_config import DEFAULT_HEARTBEAT_TTL_MS


class Replica:
    def __init__(self, address: str, client: InferenceClient):
        self.address = address
        self.client = client
        self.replica_id: str | None = None  # from its event batches
        self._is_live = False
        self.heartbeat_ttl_s = DEFAULT_HEARTBEAT_TTL_MS / 1000
        self.has_been_heard = asyncio.Event()  # its first batch came (or it sends none)
        self.num_in_flight = 0
        # Blocks this gateway's in-flight requests here still have to prefill (predicted uncached).
        self.queued_prefill_blocks = 0
        self._load = ReplicaLoad()
        self._num_in_flight_at_load = 0
        self._max_in_flight_since_load = 0
        self._last_heard_s = time.monotonic()

    @property
    def is_live(self) -> bool:
        """Routable: heard within its heartbeat TTL (kept by its watcher)."""
        return self._is_live

    @is_live.setter
    def is_live(self, is_live: bool) -> None:
        if is_live != self._is_live:
            record_replica_liveness(is_live)
        self._is_live = is_live

    @property
    def name(self) -> str:
        """How logs, results and metric labels name it: its replica_id once heard, else its address."""
        return self.replica_id or self.address

    def observe(self, batch: KvEventBatch) -> None:
        """A batch or heartbeat arrived: the replica is live, and this is its load now."""
        self.replica_id = batch.replica_id
        self._load = batch.load
        self._num_in_flight_at_load = self._max_in_flight_since_load
        self._max_in_flight_since_load = self.num_in_flight
        self._last_heard_s = time.monotonic()
        if batch.heartbeat_ttl_ms:
            self.heartbeat_ttl_s = batch.heartbeat_ttl_ms / 1000
        self.is_live = True
        self.has_been_heard.set()

    def mark_unwatched(self) -> None:
        """It serves no events: routable on the gateway's own count alone, as long as it answers."""
        self.is_live = True
        self.has_been_heard.set()

    @property
    def silent_for_s(self) -> float:
        """Since the replica last said anything: a batch, or tokens for a request (a replica
        busy generating may send its heartbeat late, but is not gone)."""
        return time.monotonic() - max(self._last_heard_s, self.client.last_output_s)

    @property
    def num_requests(self) -> int:
        reported = self._load.num_running + self._load.num_waiting
        return self.num_in_flight + max(0, reported - self._num_in_flight_at_load)

    @property
    def kv_used_fraction(self) -> float:
        return self._load.kv_blocks_used / self._load.kv_blocks_total if self._load.kv_blocks_total else 0.0

    @property
    def load_key(self) -> tuple[int, float]:
        """Ordering for "least loaded": requests first, KV in use breaks ties."""
        return self.num_requests, self.kv_used_fraction

    @contextlib.contextmanager
    def dispatched(self, prefill_blocks: int = 0) -> Iterator[Dispatch]:
        """Count one request in flight here while the block runs, and its `prefill_blocks` as
        queued prefill until it reports its first token (Dispatch.prefilled) or ends."""
        self.num_in_flight += 1
        self._max_in_flight_since_load = max(self._max_in_flight_since_load, self.num_in_flight)
        dispatch = Dispatch(self, prefill_blocks)
        self.queued_prefill_blocks += prefill_blocks
        try:
            yield dispatch
        finally:
            dispatch.prefilled()
            self.num_in_flight -= 1

    def __repr__(self) -> str:
        return f"Replica({self.replica_id or '?'} at {self.address})"


class Dispatch:
    """One request in flight on a replica, as its queued prefill counts it."""

    __slots__ = ("_replica", "_prefill_blocks")

    def __init__(self, replica: Replica, prefill_blocks: int):
        self._replica = replica
        self._prefill_blocks = prefill_blocks

    def prefilled(self) -> None:
        """Its first token came (or it ended): its prefill no longer queues on the replica."""
        self._replica.queued_prefill_blocks -= self._prefill_blocks
        self._prefill_blocks = 0

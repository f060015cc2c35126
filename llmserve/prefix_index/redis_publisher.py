"""RedisPublisher: one replica writing its own prefix-cache events into the Redis index.

Runs in the inference process, next to the replica's event log:

    subscribe() ─▶ snapshot, batch, batch, heartbeat, ... ─▶ APPLY script (one per batch)

A batch Redis refuses (RESYNC: it lost the replica's state, e.g. it restarted empty, or the
sweeper dropped the replica while it was stalled) or cannot take (IndexUnavailable) ends the
subscription; once Redis answers a PING, the publisher subscribes again, and the new
subscription's snapshot rebuilds the replica's entries. So the index heals from the replicas
and never needs a backup of its own.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

from llmserve.kv_events import KvEventBatch
from llmserve.prefix_index.interface import ApplyOutcome
from llmserve.prefix_index.redis_index import IndexUnavailable, RedisPrefixIndex

log = logging.getLogger(__name__)

# How often to ask a Redis that did not answer whether it is back.
DEFAULT_RETRY_INTERVAL_S = 0.5

Subscribe = Callable[[], AsyncIterator[KvEventBatch]]


class RedisPublisher:
    def __init__(
        self, index: RedisPrefixIndex, subscribe: Subscribe, *, retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S
    ):
        self._index = index
        self._subscribe = subscribe
        self._retry_interval_s = retry_interval_s
        self._replica_id: str | None = None

    async def run(self) -> None:
        """Publish until cancelled; then drop the replica's entries (it is stopping)."""
        try:
            while True:
                await self._publish_one_subscription()
                await self._wait_until_redis_answers()
        finally:
            await self._forget_self()

    async def _publish_one_subscription(self) -> None:
        """Apply batches until one is refused or fails, or the subscription ends."""
        async with aclosing(self._subscribe()) as batches:
            async for batch in batches:
                self._replica_id = batch.replica_id
                try:
                    outcome = await self._index.apply(batch)
                except IndexUnavailable:
                    return
                if outcome is ApplyOutcome.RESYNC:
                    log.info("Redis index lost replica %s's entries; republishing a snapshot", batch.replica_id)
                    return

    async def _wait_until_redis_answers(self) -> None:
        while not await self._index.ping():
            await asyncio.sleep(self._retry_interval_s)

    async def _forget_self(self) -> None:
        if self._replica_id is None:
            return
        try:
            await self._index.remove_replica(self._replica_id)
        except IndexUnavailable:
            pass  # the sweeper drops the entries once the liveness key expires

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

from llmserve.errors import ResourceExhausted
from llmserve.kv_events import KvEventBatch
from llmserve.prefix_index.interface import ApplyOutcome
from llmserve.prefix_index.redis_config import RedisIndexConfig
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
        """Publish until the event log closes (the replica drains) or the task is cancelled;
        then drop the replica's entries, so that no gateway routes to it for its TTL."""
        try:
            while await self._publish_one_subscription():
                await self._wait_until_redis_answers()
        finally:
            await self._forget_self()

    async def _publish_one_subscription(self) -> bool:
        """Apply batches until one is refused or fails (True: subscribe again), or the
        subscription ends (False)."""
        async with aclosing(self._subscribe()) as batches:
            try:
                async for batch in batches:
                    if not await self._apply(batch):
                        return True
            except ResourceExhausted as error:  # the log cut this subscription off
                log.warning("%s", error.message)
                return True
        return False

    async def _apply(self, batch: KvEventBatch) -> bool:
        """Whether Redis took the batch."""
        self._replica_id = batch.replica_id
        try:
            outcome = await self._index.apply(batch)
        except IndexUnavailable:
            return False
        if outcome is ApplyOutcome.RESYNC:
            log.info("Redis index lost replica %s's entries; republishing a snapshot", batch.replica_id)
        return outcome is ApplyOutcome.APPLIED

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


def start_publishing(config: RedisIndexConfig, subscribe: Subscribe) -> asyncio.Task:
    """Publish `subscribe()`'s batches to the index `config` names, in a task of its own."""

    async def publish() -> None:
        index = RedisPrefixIndex.from_config(config)
        try:
            await RedisPublisher(index, subscribe).run()
        finally:
            await index.close()

    return asyncio.get_running_loop().create_task(publish())

"""The gateway's prefix index: in this process (default) or in Redis (`--redis-url`).

In memory, the replica watchers feed it every replica's events. In Redis, the replicas write
it themselves; the gateway looks prompts up there (one round trip, bounded by
`--redis-timeout-ms`) and sweeps, every `sweep_interval_s`, the entries of replicas whose
liveness key expired (idempotent, so every gateway may sweep).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.gateway.config import GatewayConfig
from llmserve.prefix_index import MemoryPrefixIndex, PrefixIndex

if TYPE_CHECKING:
    from llmserve.prefix_index.redis_index import RedisPrefixIndex

log = logging.getLogger(__name__)


@dataclass
class RoutingIndex:
    lookups: PrefixIndex  # what the router asks
    events: PrefixIndex | None  # what the watchers feed; None: the replicas write Redis themselves
    redis: "RedisPrefixIndex | None" = None
    sweeper: asyncio.Task | None = None

    @classmethod
    def open(cls, config: GatewayConfig) -> "RoutingIndex":
        if config.redis is None:
            index = MemoryPrefixIndex()
            return cls(lookups=index, events=index)
        from llmserve.prefix_index.redis_index import RedisPrefixIndex  # redis-py: only with --redis-url

        redis_index = RedisPrefixIndex.from_config(config.redis)
        sweeper = asyncio.get_running_loop().create_task(_sweep_forever(redis_index, config.sweep_interval_s))
        return cls(lookups=redis_index, events=None, redis=redis_index, sweeper=sweeper)

    async def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
            await asyncio.gather(self.sweeper, return_exceptions=True)
        if self.redis is not None:
            await self.redis.close()


async def _sweep_forever(index: "RedisPrefixIndex", interval_s: float) -> None:
    from llmserve.prefix_index.redis_index import IndexUnavailable

    while True:
        await asyncio.sleep(interval_s)
        try:
            swept = await index.sweep()
        except IndexUnavailable:
            continue  # logged by the index; the next sweep catches up
        if swept:
            log.info("swept the entries of replicas gone from Redis: %s", ", ".join(swept))

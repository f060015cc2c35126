"""RedisPrefixIndex: the routing index in Redis, shared by every gateway.

Each replica is the only writer of its own entries (its RedisPublisher applies its event
batches, one Lua script per batch); gateways only read (one LOOKUP script per request) and
sweep. Key layout, P = the key prefix (`--redis-key-prefix`, default `{llmserve-routing}`; the
braces are a Redis Cluster hash tag, so every key, and so every script, is on one slot):

    P:block:<hash>              set   replica ids holding the block (hash: 16 hex digits)
    P:replica:<id>:blocks       set   hashes the replica holds (to drop them all at once)
    P:replica:<id>:stream       hash  incarnation, sequence_number of the last batch applied
    P:replica:<id>:live         str   the replica's load (JSON), PX = its heartbeat TTL
    P:replicas                  set   replica ids with entries (what the sweeper walks)

Nothing here has a TTL but the liveness key, and none of it is an evictable cache: run the
index on a Redis (or a database number) whose maxmemory-policy does not evict these keys, and
never share P with the tokenization cache.

Every call is bounded by `timeout_ms`. A lookup that fails or times out answers "nothing
known" (routing falls back to load); an apply that fails raises IndexUnavailable, and the
publisher starts over from a snapshot once Redis answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict
from typing import Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from llmserve.kv_events import AllCleared, BlocksStored, KvEventBatch
from llmserve.prefix_index import redis_scripts
from llmserve.prefix_index.redis_config import DEFAULT_HEARTBEAT_TTL_MS, RedisIndexConfig
from llmserve.prefix_index.interface import ApplyOutcome, PrefixMatches

log = logging.getLogger(__name__)



class IndexUnavailable(Exception):
    """Redis did not answer in time (or at all)."""


def hash_hex(block_hash: int) -> str:
    return format(block_hash, "016x")


def batch_arguments(key_prefix: str, batch: KvEventBatch) -> list[str | int]:
    """ARGV of the APPLY script for `batch`."""
    args: list[str | int] = [
        key_prefix, batch.replica_id, batch.incarnation, batch.sequence_number, int(batch.is_snapshot),
        batch.heartbeat_ttl_ms or DEFAULT_HEARTBEAT_TTL_MS, json.dumps(asdict(batch.load)),
    ]
    for event in batch.events:
        if isinstance(event, AllCleared):
            args.append("C")
        else:
            args += ["S" if isinstance(event, BlocksStored) else "R", len(event.block_hashes)]
            args += [hash_hex(block_hash) for block_hash in event.block_hashes]
    return args


class RedisPrefixIndex:
    def __init__(self, client: aioredis.Redis, *, key_prefix: str, timeout_ms: int):
        self._client = client
        self._key_prefix = key_prefix
        self._timeout_s = timeout_ms / 1000
        self._apply = client.register_script(redis_scripts.APPLY)
        self._lookup = client.register_script(redis_scripts.LOOKUP)
        self._sweep = client.register_script(redis_scripts.SWEEP)
        self._remove = client.register_script(redis_scripts.REMOVE)
        self._is_answering = True  # for logging only the transitions

    @classmethod
    def from_config(cls, config: RedisIndexConfig) -> "RedisPrefixIndex":
        timeout_s = config.timeout_ms / 1000
        # No retries: a slow or absent Redis must cost one timeout, not several.
        client = aioredis.Redis.from_url(
            config.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        return cls(client, key_prefix=config.key_prefix, timeout_ms=config.timeout_ms)

    async def apply(self, batch: KvEventBatch) -> ApplyOutcome:
        answer = await self._call(self._apply, args=batch_arguments(self._key_prefix, batch))
        return ApplyOutcome.RESYNC if answer == b"resync" else ApplyOutcome.APPLIED

    async def lookup(self, block_hashes: Sequence[int]) -> PrefixMatches:
        if not block_hashes:
            return {}
        keys = [f"{self._key_prefix}:block:{hash_hex(block_hash)}" for block_hash in block_hashes]
        try:
            flat = await self._call(self._lookup, keys=keys)
        except IndexUnavailable:
            return {}
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def remove_replica(self, replica_id: str) -> None:
        await self._call(self._remove, args=[self._key_prefix, replica_id])

    async def sweep(self) -> list[str]:
        """Forget the replicas whose liveness key expired (idempotent; any gateway may run it)."""
        return [replica_id.decode() for replica_id in await self._call(self._sweep, args=[self._key_prefix])]

    async def ping(self) -> bool:
        try:
            await self._call(self._client.ping)
        except IndexUnavailable:
            return False
        return True

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, command, **kwargs):
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await command(**kwargs)
        except (RedisError, OSError, TimeoutError) as error:
            if self._is_answering:
                log.warning("Redis routing index not answering (%s: %s)", type(error).__name__, error)
            self._is_answering = False
            raise IndexUnavailable(str(error)) from None
        if not self._is_answering:
            log.info("Redis routing index answering again")
        self._is_answering = True
        return answer

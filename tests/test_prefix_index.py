"""The routing index, both backends, on real chained block hashes; Redis is a real redis-server."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from llmserve.block_hash import HashNamespace, chain_block_hashes
from llmserve.kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEventBatch, ReplicaLoad
from llmserve.prefix_index import ApplyOutcome, MemoryPrefixIndex
from llmserve.prefix_index.redis_config import RedisIndexConfig
from llmserve.prefix_index.redis_index import IndexUnavailable, RedisPrefixIndex
from llmserve.prefix_index.redis_publisher import RedisPublisher
from tests.redis_server import redis_server  # noqa: F401 (a fixture)

BLOCK = 4
# The index stores whatever hashes replicas send: any one namespace does.
HANG_GUARD_S = 30.0  # what polls and guards wait at most: only a broken index takes this long
HASH_SEED = HashNamespace(model_fingerprint=1, tokenizer_fingerprint=2, block_size_tokens=BLOCK).seed()
SYSTEM = list(range(100, 112))  # 3 blocks
PROMPT_A = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8]  # 5 blocks
PROMPT_B = SYSTEM + [9, 9, 9, 9]  # 4 blocks, sharing the first 3 with A
HASHES_A = chain_block_hashes(PROMPT_A, BLOCK, HASH_SEED)
HASHES_B = chain_block_hashes(PROMPT_B, BLOCK, HASH_SEED)


def stored(hashes, parent=None) -> BlocksStored:
    return BlocksStored(tuple(hashes), parent, BLOCK)


def batch(replica_id, sequence_number, *events, incarnation="i1", ttl_ms=0) -> KvEventBatch:
    return KvEventBatch(replica_id, incarnation, sequence_number, tuple(events), ReplicaLoad(), ttl_ms)


def snapshot(replica_id, sequence_number, *events, **kwargs) -> KvEventBatch:
    return batch(replica_id, sequence_number, AllCleared(), *events, **kwargs)


# The index's bound on each Redis call in the tests that expect answers: far above what a loaded
# 2-core CI takes (a first call connects and loads the scripts); the down test sets its own.
ANSWERING_TIMEOUT_MS = 10_000


@pytest.fixture(params=["memory", "redis"])
async def index(request):
    if request.param == "memory":
        yield MemoryPrefixIndex()
        return
    server = request.getfixturevalue("redis_server")
    redis_index = RedisPrefixIndex.from_config(RedisIndexConfig(server.url, f"{{test-{time.monotonic_ns()}}}", ANSWERING_TIMEOUT_MS))
    yield redis_index
    await redis_index.close()


async def test_a_replica_counts_only_the_leading_blocks_it_holds(index):
    assert await index.apply(snapshot("r1", 1, stored(HASHES_A))) is ApplyOutcome.APPLIED
    assert await index.apply(snapshot("r2", 1, stored(HASHES_A[:1]))) is ApplyOutcome.APPLIED
    # r3 holds A's later blocks but not its first: no prefix of A can be reused there.
    assert await index.apply(snapshot("r3", 1, stored(HASHES_A[1:], parent=HASHES_A[0]))) is ApplyOutcome.APPLIED
    assert await index.lookup(HASHES_A) == {"r1": 5, "r2": 1}
    assert await index.lookup(HASHES_B) == {"r1": 3, "r2": 1}
    assert await index.lookup(chain_block_hashes([7] * 8, BLOCK, HASH_SEED)) == {}
    assert await index.lookup([]) == {}


async def test_removed_blocks_cut_the_chain_and_stored_ones_extend_it(index):
    await index.apply(snapshot("r1", 1, stored(HASHES_A)))
    assert await index.apply(batch("r1", 2, BlocksRemoved((HASHES_A[1],)))) is ApplyOutcome.APPLIED
    assert await index.lookup(HASHES_A) == {"r1": 1}
    assert await index.apply(batch("r1", 3, stored(HASHES_B[1:], parent=HASHES_B[0]))) is ApplyOutcome.APPLIED
    assert await index.lookup(HASHES_B) == {"r1": 4}
    assert await index.apply(batch("r1", 4, AllCleared(), stored(HASHES_A[:2]))) is ApplyOutcome.APPLIED
    assert await index.lookup(HASHES_B) == {"r1": 2}


async def test_a_snapshot_replaces_what_the_index_held(index):
    await index.apply(snapshot("r1", 5, stored(HASHES_A)))
    assert await index.apply(snapshot("r1", 9, stored(HASHES_B), incarnation="i2")) is ApplyOutcome.APPLIED
    assert await index.lookup(HASHES_A) == {"r1": 3}
    assert await index.lookup(HASHES_B) == {"r1": 4}


async def test_a_heartbeat_repeats_the_last_sequence_number(index):
    await index.apply(snapshot("r1", 3, stored(HASHES_A)))
    assert await index.apply(batch("r1", 3)) is ApplyOutcome.APPLIED
    assert await index.apply(batch("r1", 4, BlocksRemoved((HASHES_A[4],)))) is ApplyOutcome.APPLIED
    assert await index.apply(batch("r1", 4)) is ApplyOutcome.APPLIED
    assert await index.lookup(HASHES_A) == {"r1": 4}


@pytest.mark.parametrize(
    "broken",
    [
        batch("r1", 4, BlocksRemoved((HASHES_A[4],))),  # batch 3 was missed
        batch("r1", 3),  # a heartbeat after a missed batch
        batch("r1", 2, BlocksRemoved((HASHES_A[4],)), incarnation="i2"),  # the replica restarted
    ],
    ids=["gap", "heartbeat-after-gap", "new-incarnation"],
)
async def test_a_batch_that_does_not_continue_the_stream_drops_the_replica(index, broken):
    await index.apply(snapshot("r1", 1, stored(HASHES_A)))
    await index.apply(snapshot("r2", 1, stored(HASHES_A)))
    assert await index.apply(broken) is ApplyOutcome.RESYNC
    assert await index.lookup(HASHES_A) == {"r2": 5}
    # Nothing but a snapshot brings it back.
    assert await index.apply(batch("r1", broken.sequence_number + 1, stored(HASHES_B))) is ApplyOutcome.RESYNC
    assert await index.apply(snapshot("r1", 7, stored(HASHES_B))) is ApplyOutcome.APPLIED
    assert await index.lookup(HASHES_A) == {"r2": 5, "r1": 3}


async def test_an_unknown_replica_needs_a_snapshot(index):
    assert await index.apply(batch("r9", 1, stored(HASHES_A))) is ApplyOutcome.RESYNC
    assert await index.lookup(HASHES_A) == {}


async def test_remove_replica(index):
    await index.apply(snapshot("r1", 1, stored(HASHES_A)))
    await index.apply(snapshot("r2", 1, stored(HASHES_B)))
    await index.remove_replica("r1")
    await index.remove_replica("r-never-seen")
    assert await index.lookup(HASHES_A) == {"r2": 3}


async def test_the_memory_index_holds_only_what_replicas_hold():
    index = MemoryPrefixIndex()
    await index.apply(snapshot("r1", 1, stored(HASHES_A)))
    await index.apply(snapshot("r2", 1, stored(HASHES_B)))
    assert index.num_entries == 9
    await index.apply(batch("r1", 2, BlocksRemoved(tuple(HASHES_A))))
    assert index.num_entries == 4
    await index.remove_replica("r2")
    assert index.num_entries == 0
    assert await index.lookup(HASHES_B) == {}


# --- Redis only ------------------------------------------------------------------------------


@pytest.fixture
async def redis_index(redis_server):
    index = RedisPrefixIndex.from_config(RedisIndexConfig(redis_server.url, f"{{test-{time.monotonic_ns()}}}", ANSWERING_TIMEOUT_MS))
    yield index
    await index.close()


async def test_the_sweeper_drops_replicas_whose_liveness_expired(redis_index):
    await redis_index.apply(snapshot("r1", 1, stored(HASHES_A), ttl_ms=60_000))
    await redis_index.apply(snapshot("r2", 1, stored(HASHES_A), ttl_ms=60_000))
    assert await redis_index.sweep() == []
    await redis_index.apply(batch("r1", 1, ttl_ms=1))  # a heartbeat that lets r1's liveness lapse at once
    swept = await poll(redis_index.sweep)
    assert swept == ["r1"]
    assert await redis_index.sweep() == []
    assert await redis_index.lookup(HASHES_A) == {"r2": 5}
    # r1 was stalled, not gone: its next batch is refused and it republishes a snapshot.
    assert await redis_index.apply(batch("r1", 1, ttl_ms=200)) is ApplyOutcome.RESYNC


async def assert_index_down(index: RedisPrefixIndex) -> None:
    assert await index.lookup(HASHES_A) == {}
    with pytest.raises(IndexUnavailable):
        await index.apply(batch("r1", 1))
    assert not await index.ping()


async def test_redis_down_lookups_answer_nothing_and_applies_raise(redis_server):
    index = RedisPrefixIndex.from_config(RedisIndexConfig(redis_server.url, "{test-down}", 100))
    try:
        await index.apply(snapshot("r1", 1, stored(HASHES_A)))
        # Hung (stopped): connections stay open and nothing answers, so only the index's own
        # timeout can end each call; the guard fails the test where one would wait on.
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.wait_for(assert_index_down(index), HANG_GUARD_S)
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        redis_server.kill()  # gone: connections refused
        await asyncio.wait_for(assert_index_down(index), HANG_GUARD_S)
        redis_server.start()  # empty: it kept nothing
        assert await index.ping()
        assert await index.lookup(HASHES_A) == {}
        assert await index.apply(batch("r1", 1)) is ApplyOutcome.RESYNC
    finally:
        if redis_server.process is None:
            redis_server.start()
        await index.close()


class ReplicaEvents:
    """What a replica's event log serves: a snapshot of what it holds, then its new batches."""

    def __init__(self, replica_id: str):
        self.replica_id = replica_id
        self.held: list[int] = []
        self.sequence_number = 0
        self.num_subscriptions = 0
        self._subscribers: list[asyncio.Queue] = []

    def store(self, hashes: list[int]) -> None:
        self.held += hashes
        self.sequence_number += 1
        for queue in self._subscribers:
            queue.put_nowait(batch(self.replica_id, self.sequence_number, stored(hashes), ttl_ms=60_000))

    async def subscribe(self):
        self.num_subscriptions += 1
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            yield snapshot(self.replica_id, self.sequence_number, stored(self.held), ttl_ms=60_000)
            while True:
                try:
                    yield await asyncio.wait_for(queue.get(), timeout=0.05)
                except TimeoutError:  # a heartbeat
                    yield batch(self.replica_id, self.sequence_number, ttl_ms=60_000)
        finally:
            self._subscribers.remove(queue)


async def wait_for(condition, timeout_s: float = 5.0) -> None:
    await poll(condition, timeout_s)


async def poll(call, timeout_s: float = HANG_GUARD_S):
    """`await call()` until it answers something truthy (every 20 ms); that answer."""
    deadline = time.monotonic() + timeout_s
    while not (answer := await call()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
    return answer


async def test_the_publisher_rebuilds_a_restarted_redis_from_its_replica(redis_server):
    index = RedisPrefixIndex.from_config(RedisIndexConfig(redis_server.url, "{test-publisher}", 100))
    replica = ReplicaEvents("r1")
    replica.store(HASHES_A[:2])
    publisher = asyncio.create_task(RedisPublisher(index, replica.subscribe, retry_interval_s=0.05).run())
    try:
        await wait_for(lambda: _matches(index, HASHES_A, {"r1": 2}))
        replica.store(HASHES_A[2:])
        await wait_for(lambda: _matches(index, HASHES_A, {"r1": 5}))
        redis_server.kill()
        replica.store(HASHES_B[3:])  # while Redis is down
        await asyncio.sleep(0.2)
        redis_server.start()
        await wait_for(lambda: _matches(index, HASHES_B, {"r1": 4}))
        assert await index.lookup(HASHES_A) == {"r1": 5}
        assert replica.num_subscriptions >= 2
    finally:
        publisher.cancel()
        await asyncio.gather(publisher, return_exceptions=True)
    # A stopping replica takes its entries with it.
    assert await index.lookup(HASHES_A) == {}
    await index.close()


async def _matches(index, hashes, expected) -> bool:
    return await index.lookup(hashes) == expected

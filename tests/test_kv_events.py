"""KV cache events, producer side: a real inference server (torch backend, tiny random model)
serving WatchKvEvents, read the way a routing index reads it; the KvEventLog's bound on a
subscriber that never reads; the drain on SIGTERM with a subscriber connected."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
import tracemalloc
from dataclasses import dataclass

import grpc
import pytest

from llmserve.block_hash import HashNamespace, chain_block_hashes
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_process import EngineProcess
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.engine.types import EngineLoad
from llmserve.inference.kv_event_log import DEFAULT_MAX_QUEUED_BATCHES, KvEventLog, SubscriberFellBehind
from llmserve.inference.servicer import SERVICE_NAME, InferenceServicer
from llmserve.kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEventBatch, ReplicaLoad, batch_from_pb
from llmserve.message_limits import token_ids_request_bytes
from llmserve.server import CHANNEL_OPTIONS, RunningServer, create_server
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from llmserve.tools.service_process import start_service
from tests.test_block_manager import BLOCK_SIZE as SMALL_BLOCK
from tests.test_block_manager import HASH_SEED, compute, make_seq

pytestmark = pytest.mark.asyncio(loop_scope="session")

BLOCK = 16  # the engine's default block size
HEARTBEAT_MS = 50
HANG_GUARD_S = 30.0
POOL_BLOCKS = 64
SHARED = list(range(3, 3 + 2 * BLOCK))  # a prefix of two full blocks
_prompt_ids = itertools.count(1)


@dataclass
class Replica:
    engine: AsyncEngine
    kv_events: KvEventLog
    running: RunningServer
    channel: grpc.aio.Channel
    stub: inference_pb2_grpc.InferenceServiceStub
    core: TorchEngineCore | None  # the thread path's core, whose block manager the test reads


def replica_hashes(model_dir, prompt: list[int]) -> list[int]:
    """The chained block hashes a replica of `model_dir` gives `prompt` (no cache salt)."""
    return HashNamespace.of_model_dir(model_dir, BLOCK).block_hashes(prompt)


async def start_replica(
    model_dir, *, core_process: bool, num_kv_blocks: int = POOL_BLOCKS, max_queued_batches: int = DEFAULT_MAX_QUEUED_BATCHES
) -> Replica:
    config = EngineConfig(model_path=model_dir, model_name="tiny", backend="torch", num_kv_blocks=num_kv_blocks)
    core = None if core_process else TorchEngineCore(config)
    engine = AsyncEngine(EngineProcess(config) if core_process else EngineThread(core))
    kv_events = KvEventLog.of(
        engine, replica_id="kv-replica", default_heartbeat_interval_s=HEARTBEAT_MS / 1000,
        max_queued_batches=max_queued_batches,
    )  # fmt: skip
    await engine.start()
    servicer = InferenceServicer(engine, kv_events)
    running = await create_server(
        "127.0.0.1:0",
        lambda server: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        max_receive_bytes=token_ids_request_bytes(engine.model_info.max_context_tokens, BLOCK),
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", options=CHANNEL_OPTIONS)
    return Replica(engine, kv_events, running, channel, inference_pb2_grpc.InferenceServiceStub(channel), core)


async def stop_replica(replica: Replica) -> None:
    replica.kv_events.close()
    await replica.channel.close()
    await replica.engine.shutdown(drain_timeout_s=0.0)
    await replica.running.server.stop(0)


@pytest.fixture(scope="module")
async def replica(tiny_model_dir):
    replica = await start_replica(tiny_model_dir, core_process=False)
    yield replica
    await stop_replica(replica)


class Watcher:
    """One WatchKvEvents stream applied to a local index the way a routing index applies it,
    checking the numbering as it goes."""

    def __init__(self, stub, *, load_only: bool = False, heartbeat_ms: int = HEARTBEAT_MS):
        request = inference_pb2.WatchKvEventsRequest(heartbeat_interval_ms=heartbeat_ms, load_only=load_only)
        self.call = stub.WatchKvEvents(request)
        self.load_only = load_only
        self.parents: dict[int, int | None] = {}  # what the replica holds: block hash → parent
        self.stored: list[BlocksStored] = []  # since the snapshot
        self.removed: list[int] = []
        self.sequence_number: int | None = None

    async def read(self) -> KvEventBatch:
        batch = batch_from_pb(await asyncio.wait_for(self.call.read(), HANG_GUARD_S))
        if self.sequence_number is None:
            assert batch.is_snapshot or self.load_only
        elif batch.events:
            assert batch.sequence_number == self.sequence_number + 1, "a gap"
        elif not self.load_only:
            assert batch.sequence_number == self.sequence_number, "a heartbeat repeats the last number"
        self.sequence_number = batch.sequence_number
        for event in batch.events:
            self._apply(event)
        return batch

    async def read_until(self, predicate) -> None:
        while not predicate():
            await self.read()

    def _apply(self, event) -> None:
        if isinstance(event, AllCleared):
            self.parents.clear()
        elif isinstance(event, BlocksStored):
            assert event.block_size_tokens == BLOCK
            assert event.parent_block_hash is None or event.parent_block_hash in self.parents
            for block_hash, parent in zip(event.block_hashes, (event.parent_block_hash, *event.block_hashes)):
                self.parents[block_hash] = parent
            self.stored.append(event)
        else:
            assert isinstance(event, BlocksRemoved)
            for block_hash in event.block_hashes:
                del self.parents[block_hash]
            self.removed += event.block_hashes


async def generate(stub, prompt: list[int], max_tokens: int = 2) -> None:
    """Run a request to its end. max_tokens=2: the last sampled token is never computed, so
    only the prompt's full blocks fill (prompt + 1 tokens computed)."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = inference_pb2.GenerateTokensRequest(
        request_id=f"kv-{next(_prompt_ids)}", prompt_token_ids=prompt, sampling=sampling
    )

    async def consume():
        return [response async for response in stub.GenerateTokens(request)]

    await asyncio.wait_for(consume(), HANG_GUARD_S)


def distinct_prompt(num_tokens: int) -> list[int]:
    """A prompt no other prompt of this module starts like (the first token differs)."""
    first = 300 + next(_prompt_ids)
    return [first] + [7 + i % 200 for i in range(num_tokens - 1)]


def registered_hashes(core: TorchEngineCore) -> set[int]:
    return {block.block_hash for block in core.block_manager.blocks if block.block_hash is not None}


async def late_snapshot(stub) -> Watcher:
    watcher = Watcher(stub)
    await watcher.read()
    return watcher


# --- the engine's record, and the log on its own -------------------------------------------


async def test_the_block_manager_records_runs_of_stored_blocks_and_evictions():
    manager = BlockManager(num_blocks=8, block_size=SMALL_BLOCK)
    first = make_seq(range(10), seq_id=1)  # two full blocks, computed in one step
    compute(manager, first)
    hashes = chain_block_hashes(list(range(10)), SMALL_BLOCK, HASH_SEED)
    assert manager.take_events() == [(None, hashes)]
    assert manager.take_events() == []
    second = make_seq([0, 1, 2, 3, 9, 9, 9, 9, 9], seq_id=2)  # shares the first block: stores one
    compute(manager, second)
    second_hashes = chain_block_hashes(second.token_ids, SMALL_BLOCK, HASH_SEED)
    assert manager.take_events() == [(hashes[0], [second_hashes[1]])]
    manager.free(first)
    manager.free(second)
    assert manager.take_events() == []  # freed blocks stay findable
    third = make_seq(range(100, 132), seq_id=3)  # the whole pool: every cached block is evicted
    compute(manager, third)
    events = manager.take_events()
    assert sorted(events[:3]) == sorted([*hashes, second_hashes[1]])  # evicted before the store
    assert events[3:] == [(None, chain_block_hashes(third.token_ids, SMALL_BLOCK, HASH_SEED))]


async def test_the_log_keeps_the_order_of_a_batch_and_snapshots_parents_first():
    log = KvEventLog(BLOCK, lambda: EngineLoad(0, 0, POOL_BLOCKS, 0))
    live = log.subscribe(load_only=False, heartbeat_interval_s=60.0)
    await anext(live)
    log.record([(None, [1, 2]), 2, 1, (None, [1])])  # block 1 evicted, then stored again
    log.record([(1, [2])])
    assert (await anext(live)).events == (
        BlocksStored((1, 2), None, BLOCK), BlocksRemoved((2, 1)), BlocksStored((1,), None, BLOCK),
    )
    assert (await anext(live)).events == (BlocksStored((2,), 1, BLOCK),)
    log.record([(None, [5])])
    log.record([(None, [3]), (3, [4]), 3])  # 4 outlives its parent: sent after what it extends
    log.record([(None, [3])])
    snapshot = await anext(log.subscribe(load_only=False, heartbeat_interval_s=60.0))
    assert snapshot.sequence_number == 5
    assert snapshot.events == (
        AllCleared(), BlocksStored((1, 2), None, BLOCK), BlocksStored((5,), None, BLOCK),
        BlocksStored((3, 4), None, BLOCK),
    )
    log.close()


# --- a real server --------------------------------------------------------------------------


@pytest.mark.parametrize("core_process", [True, False], ids=["engine-process", "engine-thread"])
async def test_stored_blocks_are_the_prompts_chained_hashes(tiny_model_dir, core_process):
    replica = await start_replica(tiny_model_dir, core_process=core_process)
    try:
        watcher = Watcher(replica.stub)
        snapshot = await watcher.read()
        assert (snapshot.events, snapshot.sequence_number) == ((AllCleared(),), 0)
        assert (snapshot.replica_id, len(snapshot.incarnation)) == ("kv-replica", 32)

        prompt_a = SHARED + list(range(100, 120))  # 52 tokens: three full blocks
        hashes_a = replica_hashes(tiny_model_dir, prompt_a)
        await generate(replica.stub, prompt_a)
        await watcher.read_until(lambda: watcher.stored)
        assert watcher.stored == [BlocksStored(tuple(hashes_a), None, BLOCK)]

        prompt_b = SHARED + list(range(200, 220))  # the same first two blocks: only its third is new
        hashes_b = replica_hashes(tiny_model_dir, prompt_b)
        await generate(replica.stub, prompt_b)
        await watcher.read_until(lambda: len(watcher.stored) == 2)
        assert watcher.stored[1] == BlocksStored((hashes_b[2],), hashes_a[1], BLOCK)

        # Exactly the shared blocks: the last prompt token is always computed, so its block is
        # recomputed into a fresh block, which is not stored again (its hash is cached).
        await generate(replica.stub, SHARED)
        late = await late_snapshot(replica.stub)
        assert late.sequence_number == 2
        await watcher.read_until(lambda: watcher.sequence_number == late.sequence_number)
        assert late.parents == watcher.parents == {
            hashes_a[0]: None, hashes_a[1]: hashes_a[0], hashes_a[2]: hashes_a[1], hashes_b[2]: hashes_a[1],
        }
        assert len(watcher.stored) == 2 and not watcher.removed
        if replica.core is not None:
            assert registered_hashes(replica.core) == set(late.parents)
        watcher.call.cancel()
    finally:
        await stop_replica(replica)


async def test_eviction_removes_blocks_and_the_snapshot_shrinks(tiny_model_dir):
    pool_blocks = 8
    replica = await start_replica(tiny_model_dir, core_process=False, num_kv_blocks=pool_blocks)
    try:
        watcher = Watcher(replica.stub)
        await watcher.read()
        prompts = [distinct_prompt(2 * BLOCK + 8) for _ in range(6)]  # 2 full blocks each, 12 in all
        for prompt in prompts:
            await generate(replica.stub, prompt)
        late = await late_snapshot(replica.stub)
        await watcher.read_until(lambda: watcher.sequence_number == late.sequence_number)
        stored = [block_hash for event in watcher.stored for block_hash in event.block_hashes]
        assert stored == [block_hash for prompt in prompts for block_hash in replica_hashes(tiny_model_dir, prompt)]
        assert watcher.removed and set(watcher.removed) <= set(stored)
        assert late.parents == watcher.parents
        assert set(late.parents) == registered_hashes(replica.core) == set(stored) - set(watcher.removed)
        assert len(late.parents) <= pool_blocks
        assert not set(replica_hashes(tiny_model_dir, prompts[0])) & set(late.parents)  # least recently used first
        watcher.call.cancel()
    finally:
        await stop_replica(replica)


async def test_heartbeats_carry_the_load_when_idle(replica):
    watcher = Watcher(replica.stub)
    snapshot = await watcher.read()
    started = time.monotonic()
    beats = [await watcher.read() for _ in range(3)]
    assert time.monotonic() - started >= 2.5 * HEARTBEAT_MS / 1000
    for beat in beats:
        assert beat.events == ()
        assert (beat.replica_id, beat.incarnation, beat.sequence_number) == (
            "kv-replica", snapshot.incarnation, snapshot.sequence_number,
        )
        assert beat.load == ReplicaLoad(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=POOL_BLOCKS)
        assert beat.heartbeat_ttl_ms == 4 * HEARTBEAT_MS
    watcher.call.cancel()


async def test_a_batch_carries_the_load_of_its_step(replica):
    watcher = Watcher(replica.stub)
    await watcher.read()
    generation = asyncio.create_task(generate(replica.stub, distinct_prompt(40), max_tokens=60))
    batch = await watcher.read()
    while not batch.events:
        batch = await watcher.read()
    assert batch.load.num_running == 1 and batch.load.kv_blocks_used > 0
    await generation
    watcher.call.cancel()


async def test_load_only_gets_heartbeats_and_no_events(replica):
    watcher = Watcher(replica.stub, load_only=True)
    first = await watcher.read()
    await generate(replica.stub, distinct_prompt(40))
    later = [await watcher.read() for _ in range(3)]
    assert all(batch.events == () for batch in [first, *later])
    assert later[-1].sequence_number > first.sequence_number  # the number of the last batch
    assert later[-1].heartbeat_ttl_ms == 4 * HEARTBEAT_MS
    watcher.call.cancel()


async def test_a_watcher_that_does_not_read_holds_nothing_back(replica, tiny_model_dir):
    stalled = replica.stub.WatchKvEvents(inference_pb2.WatchKvEventsRequest(heartbeat_interval_ms=10))
    watcher = Watcher(replica.stub)
    await watcher.read()
    prompts = [distinct_prompt(40) for _ in range(10)]
    for prompt in prompts:
        await generate(replica.stub, prompt)
    wanted = {block_hash for prompt in prompts for block_hash in replica_hashes(tiny_model_dir, prompt)}
    await watcher.read_until(lambda: wanted <= watcher.parents.keys())
    stalled.cancel()
    watcher.call.cancel()


async def test_a_watcher_that_does_not_read_is_cut_off(tiny_model_dir):
    replica = await start_replica(tiny_model_dir, core_process=False, max_queued_batches=4)
    # A 1 KiB HTTP/2 window that never grows: the server's writes block after a few batches,
    # and the rest pile up in the subscription's queue.
    options = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.running.port}", options=options) as channel:
            stalled = Watcher(inference_pb2_grpc.InferenceServiceStub(channel), heartbeat_ms=60_000)
            await stalled.read()
            num_prompts = 40
            for _ in range(num_prompts):
                await generate(replica.stub, distinct_prompt(200))  # each step stores 12 blocks
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stalled.read_until(lambda: False)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "resubscribe for a fresh snapshot" in error.value.details()
        assert 0 < len(stalled.stored) < num_prompts
        fresh = await late_snapshot(replica.stub)
        assert fresh.sequence_number == num_prompts
        fresh.call.cancel()
    finally:
        await stop_replica(replica)


async def test_a_heartbeat_interval_out_of_range_is_refused(replica):
    call = replica.stub.WatchKvEvents(inference_pb2.WatchKvEventsRequest(heartbeat_interval_ms=5))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call.read()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "heartbeat_interval_ms: must be 0 (the replica's default) or in [10, 600000]"


async def test_a_subscriber_that_never_reads_is_cut_off_and_memory_stays_bounded():
    max_queued_batches = 8
    log = KvEventLog(BLOCK, lambda: EngineLoad(0, 0, POOL_BLOCKS, 0), max_queued_batches=max_queued_batches)
    stalled = log.subscribe(load_only=False, heartbeat_interval_s=60.0)
    await anext(stalled)  # the snapshot; then it reads no more
    tracemalloc.start()
    try:
        baseline, _ = tracemalloc.get_traced_memory()
        for block_hash in range(1, 5001):  # stored then removed: the cache itself stays empty
            log.record([(None, [block_hash])])
            log.record([block_hash])
        retained, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert retained - baseline < 100_000  # 10,000 batches held would be megabytes
    with pytest.raises(SubscriberFellBehind):
        await anext(stalled)
    fresh = log.subscribe(load_only=False, heartbeat_interval_s=60.0)
    snapshot = await anext(fresh)
    assert (snapshot.events, snapshot.sequence_number) == ((AllCleared(),), 10_000)
    log.close()
    assert [batch async for batch in fresh] == []  # closing ends the subscription cleanly


async def test_sigterm_drains_with_a_subscriber_connected(tiny_model_dir, tmp_path):
    grace_s = 60
    service = await asyncio.to_thread(
        start_service, "inference",
        ["--model", str(tiny_model_dir), "--backend", "torch", "--grace-period-s", str(grace_s)], tmp_path,
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            watcher = Watcher(stub)
            await watcher.read()
            sampling = common_pb2.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            call = stub.GenerateTokens(
                inference_pb2.GenerateTokensRequest(request_id="drain", prompt_token_ids=SHARED, sampling=sampling)
            )
            first = await asyncio.wait_for(call.read(), HANG_GUARD_S)
            signalled = time.monotonic()
            service.send_signal(signal.SIGTERM)
            while (message := await asyncio.wait_for(watcher.call.read(), HANG_GUARD_S)) is not grpc.aio.EOF:
                assert message.replica_id
            assert await watcher.call.code() == grpc.StatusCode.OK
            num_tokens = len(first.token_ids)
            while (response := await asyncio.wait_for(call.read(), HANG_GUARD_S)) is not grpc.aio.EOF:
                num_tokens += len(response.token_ids)
        assert num_tokens == 40
        assert await asyncio.to_thread(service.wait, grace_s) == 0
        assert time.monotonic() - signalled < grace_s / 2  # the watch stream did not hold the drain
    finally:
        service.kill()

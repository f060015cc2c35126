"""Router decisions and target discovery, in process: real replicas' state, a real in-memory index;
the routing metrics they move, read from this process's registry."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from llmserve import token_id_bytes
from llmserve.block_hash import HASH_VERSION, HashNamespace, chain_block_hashes
from llmserve.errors import Unavailable
from llmserve.gateway.discovery import AddressWatcher, Target, resolve
from llmserve.gateway.inference_client import InferenceClient
from llmserve.gateway.preprocess_client import PreparedPrompt
from llmserve.gateway.replica import Replica
from llmserve.gateway.router import FallbackCause, RouteReason, Router, RoutingConfig, RoutingPolicy
from llmserve.kv_events import AllCleared, BlocksStored, KvEventBatch, ReplicaLoad
from llmserve.prefix_index import MemoryPrefixIndex

BLOCK = 4
# The router compares hashes only: any one namespace does.
HASH_SEED = HashNamespace(model_fingerprint=1, tokenizer_fingerprint=2, block_size_tokens=BLOCK).seed()
TOKENS = list(range(1, 18))  # 4 full blocks and one token
HASHES = chain_block_hashes(TOKENS, BLOCK, HASH_SEED)
PROMPT = PreparedPrompt(token_id_bytes.pack(TOKENS), HASHES, BLOCK, HASH_VERSION, cache_salt="", max_tokens=4, preprocess_time_ns=0)


async def fleet(index: MemoryPrefixIndex, held_blocks: dict[str, int], running: dict[str, int]) -> list[Replica]:
    """Replicas r0, r1, ... holding their first `held_blocks` blocks of PROMPT, with `running` requests."""
    replicas = []
    for replica_id, num_blocks in held_blocks.items():
        replica = Replica(f"127.0.0.1:{1 + len(replicas)}", InferenceClient(f"127.0.0.1:{1 + len(replicas)}"))
        events = (AllCleared(), BlocksStored(tuple(HASHES[:num_blocks]), None, BLOCK)) if num_blocks else (AllCleared(),)
        batch = KvEventBatch(replica_id, "i", 1, events, ReplicaLoad(num_running=running.get(replica_id, 0)))
        replica.observe(batch)
        await index.apply(batch)
        replicas.append(replica)
    return replicas


def router(replicas, index, policy=RoutingPolicy.KV, **bound) -> Router:
    """Without the load weight unless asked: these tests pin the other terms of the cost."""
    bound.setdefault("load_weight", 0.0)
    return Router(RoutingConfig(policy, **bound), lambda: [r for r in replicas if r.is_live], index)


async def test_kv_picks_the_longest_prefix_and_predicts_what_the_engine_reuses():
    index = MemoryPrefixIndex()
    replicas = await fleet(index, {"r0": 1, "r1": 4, "r2": 0}, {})
    decision = await router(replicas, index).choose(PROMPT)
    assert decision.replica.replica_id == "r1"
    assert decision.predicted_cached_tokens == 4 * BLOCK
    fully_cached = PreparedPrompt(token_id_bytes.pack(TOKENS[:16]), HASHES, BLOCK, HASH_VERSION, "", 4, 0)
    assert (await router(replicas, index).choose(fully_cached)).predicted_cached_tokens == 3 * BLOCK


async def test_the_load_bound_sends_a_busy_holder_s_request_elsewhere():
    index = MemoryPrefixIndex()
    replicas = await fleet(index, {"r0": 4, "r1": 2, "r2": 0}, {"r0": 7, "r1": 3, "r2": 2})
    # bound = max(2 x 1.5, 2 + 1) = 3: r0 is out, r1 holds the longest prefix of those left.
    decision = await router(replicas, index, load_ratio=1.5, load_slack=1).choose(PROMPT)
    assert (decision.replica.replica_id, decision.predicted_cached_tokens) == ("r1", 2 * BLOCK)
    # The gateway's own in-flight requests count at once.
    with replicas[1].dispatched():
        decision = await router(replicas, index, load_ratio=1.5, load_slack=1).choose(PROMPT)
    assert (decision.replica.replica_id, decision.predicted_cached_tokens) == ("r2", 0)


async def test_a_holder_s_prefill_queue_counts_against_what_it_holds():
    index = MemoryPrefixIndex()
    replicas = await fleet(index, {"r0": 4, "r1": 2}, {})
    # PROMPT has 5 blocks: r0 computes 1, r1 computes 3.
    assert (await router(replicas, index, queue_weight=1).choose(PROMPT)).replica.replica_id == "r0"
    with replicas[0].dispatched(prefill_blocks=2):  # r0: 1 + 2 queued = r1: 3; fewer requests wins
        decision = await router(replicas, index, queue_weight=1).choose(PROMPT)
        assert (decision.replica.replica_id, decision.prefill_blocks) == ("r1", 3)
        # Weight 0: the longest prefix, whatever the queue.
        assert (await router(replicas, index, queue_weight=0).choose(PROMPT)).replica.replica_id == "r0"
    with replicas[0].dispatched(prefill_blocks=1):  # r0: 1 + 1 < r1: 3
        assert (await router(replicas, index, queue_weight=1).choose(PROMPT)).replica.replica_id == "r0"
    # Its first token ends a request's queued prefill, before the request itself ends.
    with replicas[0].dispatched(prefill_blocks=10) as dispatch:
        dispatch.prefilled()
        assert replicas[0].queued_prefill_blocks == 0
        assert (await router(replicas, index, queue_weight=1).choose(PROMPT)).replica.replica_id == "r0"
    assert replicas[0].queued_prefill_blocks == 0


async def test_requests_in_flight_count_against_what_a_replica_holds():
    index = MemoryPrefixIndex()
    # PROMPT has 5 blocks: r0 computes 1, r1 computes 3; no bound in the way (slack 10).
    replicas = await fleet(index, {"r0": 4, "r1": 2}, {"r0": 4, "r1": 1})
    # Weight 1: r0 costs 1 + 4 in flight, r1 3 + 1: the quieter replica wins a 2-block difference.
    decision = await router(replicas, index, load_slack=10, load_weight=1).choose(PROMPT)
    assert (decision.replica.replica_id, decision.predicted_cached_tokens) == ("r1", 2 * BLOCK)
    # Weight 0.5: 1 + 2 < 3 + 0.5: the longer prefix still wins.
    assert (await router(replicas, index, load_slack=10, load_weight=0.5).choose(PROMPT)).replica.replica_id == "r0"
    assert (await router(replicas, index, load_slack=10, load_weight=0).choose(PROMPT)).replica.replica_id == "r0"
    assert RoutingConfig().load_weight == 1  # the default
    with pytest.raises(ValueError, match="load weight"):
        RoutingConfig(load_weight=-1)


async def test_nothing_cached_goes_to_the_least_loaded():
    index = MemoryPrefixIndex()
    replicas = await fleet(index, {"r0": 0, "r1": 0, "r2": 0}, {"r0": 2, "r1": 1, "r2": 3})
    for policy in (RoutingPolicy.KV, RoutingPolicy.LEAST_LOADED):
        decision = await router(replicas, index, policy).choose(PROMPT)
        assert (decision.replica.replica_id, decision.predicted_cached_tokens) == ("r1", 0)


async def test_round_robin_takes_each_live_replica_in_turn():
    index = MemoryPrefixIndex()
    replicas = await fleet(index, {"r0": 4, "r1": 0, "r2": 0}, {})
    replicas[2].is_live = False
    round_robin = router(replicas, index, RoutingPolicy.ROUND_ROBIN)
    chosen = [(await round_robin.choose(PROMPT)).replica.replica_id for _ in range(4)]
    assert chosen == ["r0", "r1", "r0", "r1"]


async def test_no_live_replica_is_unavailable():
    index = MemoryPrefixIndex()
    replicas = await fleet(index, {"r0": 4}, {})
    replicas[0].is_live = False
    with pytest.raises(Unavailable, match="^inference unavailable: "):
        await router(replicas, index).choose(PROMPT)


def routing_sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"llmserve_routing_{name}", labels) or 0.0


# (held blocks, running requests, policy) → the replica chosen, why, and why it fell back.
REASONS = [
    ({"r0": 1, "r1": 4}, {}, RoutingPolicy.KV, ("r1", RouteReason.PREFIX, None)),
    ({"r0": 0, "r1": 0}, {"r0": 1}, RoutingPolicy.KV, ("r1", RouteReason.FALLBACK, FallbackCause.NO_MATCH)),
    # bound = max(0 x 1.5, 0 + 1) = 1: r0 holds the prompt and is past it.
    ({"r0": 4, "r1": 0}, {"r0": 5}, RoutingPolicy.KV, ("r1", RouteReason.FALLBACK, FallbackCause.IMBALANCE)),
    ({"r0": 4, "r1": 0}, {"r0": 1}, RoutingPolicy.LEAST_LOADED, ("r1", RouteReason.LOAD, None)),
    ({"r0": 4}, {"r0": 9}, RoutingPolicy.KV, ("r0", RouteReason.LOAD, None)),
    ({"r0": 4}, {}, RoutingPolicy.ROUND_ROBIN, ("r0", RouteReason.ROUND_ROBIN, None)),
]


@pytest.mark.parametrize("held_blocks, running, policy, expected", REASONS)
async def test_a_decision_says_why_and_is_counted(held_blocks, running, policy, expected):
    index = MemoryPrefixIndex()
    replicas = await fleet(index, held_blocks, running)
    replica_id, reason, cause = expected
    decisions_before = routing_sample("decisions_total", replica=replica_id, reason=reason.value)
    fallbacks_before = {c: routing_sample("fallbacks_total", cause=c.value) for c in FallbackCause}
    decision = await router(replicas, index, policy, load_ratio=1.5, load_slack=1).choose(PROMPT)
    assert (decision.replica.replica_id, decision.reason, decision.fallback_cause) == expected
    assert routing_sample("decisions_total", replica=replica_id, reason=reason.value) == decisions_before + 1
    for c in FallbackCause:
        assert routing_sample("fallbacks_total", cause=c.value) == fallbacks_before[c] + (c is cause)


async def test_replicas_live_counts_each_change_of_liveness_once():
    before = routing_sample("replicas_live")
    replicas = await fleet(MemoryPrefixIndex(), {"r0": 0, "r1": 0}, {})
    assert routing_sample("replicas_live") == before + 2
    replicas[0].observe(KvEventBatch("r0", "i", 2, (), ReplicaLoad()))  # a heartbeat: still live
    replicas[1].is_live = False
    replicas[1].is_live = False
    assert routing_sample("replicas_live") == before + 1
    replicas[0].is_live = False
    assert routing_sample("replicas_live") == before


@pytest.mark.parametrize(
    "text, target",
    [
        ("127.0.0.1:50053", Target("127.0.0.1", 50053, False)),
        ("dns:///inference.default.svc:50053", Target("inference.default.svc", 50053, True)),
        ("[::1]:7", Target("::1", 7, False)),
    ],
)
def test_targets_parse(text, target):
    assert Target.parse(text) == target
    assert str(target) == text


@pytest.mark.parametrize("text", ["localhost", "dns:///name", "host:0", "host:port", ":80"])
def test_bad_targets_name_the_syntax(text):
    with pytest.raises(ValueError, match="is not host:port or dns:///name:port"):
        Target.parse(text)


async def test_dns_targets_resolve_to_every_address_and_a_failing_name_drops_none():
    assert await resolve(Target.parse("127.0.0.1:9")) == {"127.0.0.1:9"}
    assert "127.0.0.1:9" in await resolve(Target.parse("dns:///localhost:9"))
    watcher = AddressWatcher([Target.parse("dns:///localhost:9"), Target.parse("dns:///no-such-host.invalid:9")])
    assert not watcher.is_static
    first = await watcher.resolve()
    assert "127.0.0.1:9" in first
    assert await watcher.resolve() == first
    assert AddressWatcher([Target.parse("127.0.0.1:9")]).is_static


async def test_start_up_waits_for_a_name_that_lists_nothing_yet():
    # A headless Service lists no pod before one is ready: resolve again until the timeout.
    assert "127.0.0.1:9" in await AddressWatcher([Target.parse("dns:///localhost:9")], 0.05).resolve_some(5)
    watcher = AddressWatcher([Target.parse("dns:///no-such-host.invalid:9")], interval_s=0.05)
    started = time.monotonic()
    assert await watcher.resolve_some(0.3) == frozenset()
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("load_weight", -1.0, "routing load weight must be >= 0, got -1.0"),
        ("queue_weight", -0.5, "routing queue weight must be >= 0, got -0.5"),
        ("load_ratio", 0.5, "routing load ratio must be >= 1, got 0.5"),
        ("load_slack", -1, "routing load slack must be >= 0, got -1"),
    ],
)
def test_routing_config_refuses_a_value_below_its_bound_naming_it(field, value, message):
    with pytest.raises(ValueError) as error:
        RoutingConfig(**{field: value})
    assert str(error.value) == message


async def test_kv_pull_sends_a_busy_holder_s_request_to_a_quieter_replica_that_pulls_the_prefix():
    index = MemoryPrefixIndex()
    replicas = await fleet(index, {"r0": 4, "r1": 0, "r2": 2}, {"r0": 5, "r1": 0, "r2": 0})
    # bound = max(0 x 1.5, 0 + 1) = 1: r0 holds the prompt and is past it.
    without = await router(replicas, index, load_ratio=1.5, load_slack=1).choose(PROMPT)
    assert (without.replica.replica_id, without.reason, without.pull_from) == ("r2", RouteReason.PREFIX, None)
    decision = await router(replicas, index, load_ratio=1.5, load_slack=1, kv_pull=True).choose(PROMPT)
    # r1: 1 block to compute + 0.1 x 4 pulled; r2: 1 + 0.1 x 2 pulled (the 2 it lacks), less.
    assert (decision.replica.replica_id, decision.reason, decision.pull_from.replica_id) == ("r2", RouteReason.PULL, "r0")
    assert (decision.pull_blocks, decision.predicted_cached_tokens, decision.prefill_blocks) == (4, 4 * BLOCK, 1)


async def test_kv_pull_is_weighed_against_the_holder_s_queue_and_the_cost_of_a_pulled_block():
    index = MemoryPrefixIndex()
    replicas = await fleet(index, {"r0": 4, "r1": 0}, {"r0": 1, "r1": 0})
    # Within the bound; the holder's one request (load weight 1) costs more than pulling 4 blocks.
    pulled = await router(replicas, index, load_weight=1.0, kv_pull=True).choose(PROMPT)
    assert (pulled.replica.replica_id, pulled.reason, pulled.pull_from.replica_id) == ("r1", RouteReason.PULL, "r0")
    # A pulled block as dear as a computed one: the holder's queue is the cheaper wait.
    held = await router(replicas, index, load_weight=1.0, kv_pull=True, pull_block_cost=1.0).choose(PROMPT)
    assert (held.replica.replica_id, held.reason, held.pull_from) == ("r0", RouteReason.PREFIX, None)
    # Nobody holds anything: nothing to pull.
    empty = await fleet(MemoryPrefixIndex(), {"r0": 0, "r1": 0}, {})
    decision = await router(empty, MemoryPrefixIndex(), kv_pull=True).choose(PROMPT)
    assert (decision.reason, decision.pull_from) == (RouteReason.FALLBACK, None)

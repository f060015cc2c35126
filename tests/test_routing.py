"""Many replicas as one prefix cache (issue 10), end to end: real preprocess, three real inference
replicas (torch, tiny model) and gateways, as processes; a real redis-server.

The workload is a shared-prefix chat: a few system prompts, many users, several turns each,
sent as token ids so that every prefix is known exactly. "Ideal" is what one replica with an
unbounded cache would reuse: for each request, the longest block-aligned prefix of it that an
already finished request had. Round-robin warms every system prompt on every replica, so the
difference routing makes is the conversation history, which only the replica that served the
previous turn holds: the history share is what round-robin loses.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
import redis

from llmserve.block_hash import HashNamespace, chain_block_hashes
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from llmserve.tools.service_process import start_service, stop_service
from tests.redis_server import redis_server  # noqa: F401 (a fixture)

NUM_REPLICAS = 3
BLOCK = 16
# Hashes here only name finished prefixes for the ideal: any one namespace does.
HASH_SEED = HashNamespace(model_fingerprint=1, tokenizer_fingerprint=2, block_size_tokens=BLOCK).seed()
VOCAB = 400  # below the tiny tokenizer's vocabulary
HEARTBEAT_MS = 250  # the replicas' heartbeat; their TTL is 4 intervals (1 s: a loaded CI box is slow)
KEY_PREFIX = "{test-routing}"
SYSTEM_TOKENS = 2 * BLOCK
TURN_TOKENS = 5 * BLOCK
NUM_SYSTEM_PROMPTS = 3
NUM_TURNS = 2
NUM_CLIENTS = 18  # ~4-5 requests in flight per replica: a +1 is not already a 1.5x imbalance
NUM_USERS = 54
# The router's defaults: the bound (1.5x or +4) and a load weight of 1 block per request, which
# spreads first turns (2 cached blocks) long before it would move a second turn (7). Measured on
# a 2-core machine, 18 clients: without the weight, slack 1 left the mean loads past 1.5x in 2 of
# 3 runs (slack 2 failed CI); a tighter bound with the weight (slack 1 or 2) kept the loads even
# but moved up to 9 of 54 second turns off their history (0.83 of it). How even the loads stay
# depends on how the CPU shares its cores between the replicas (3 busy loops beside the show
# took them from 1.24x to 1.47x): bench/bench_routing.py measures them on this workload (its
# docstring has the command line), this test asserts what routing reuses.
# Long enough that a request occupies its replica for a while: load is what is in flight.
TURN_MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(tiny_model_dir, redis_server, tmp_path_factory):
    """Preprocess and three replicas publishing their events to Redis too (a gateway without
    --redis-url reads the events itself and ignores Redis)."""
    log_dir = tmp_path_factory.mktemp("routing-logs")
    model = ["--model", str(tiny_model_dir)]
    started = []
    try:
        started.append(start_service("preprocess", model, log_dir))
        for i in range(NUM_REPLICAS):
            started.append(start_service(
                f"inference-{i}", [*model, "--replica-id", f"r{i}", "--kv-events-heartbeat-ms", str(HEARTBEAT_MS),
                                   "--num-kv-blocks", "512", "--redis-url", redis_server.url,
                                   "--redis-key-prefix", KEY_PREFIX, "--redis-timeout-ms", "200"],
                log_dir, module="llmserve.inference",
            ))
        yield {"preprocess": started[0], "replicas": started[1:], "log_dir": log_dir, "model": model}
    finally:
        for service in reversed(started):
            if service.poll() is None:
                service.send_signal(signal.SIGCONT)
                stop_service(service)


def start_gateway(stack, name: str, *flags: str):
    replicas = [arg for replica in stack["replicas"] for arg in ("--inference", replica.address)]
    return start_service(
        name, [*stack["model"], "--preprocess", stack["preprocess"].address, *replicas, *flags],
        stack["log_dir"], module="llmserve.gateway",
    )


@dataclass
class Served:
    prompt: list[int]
    ideal_tokens: int
    result: gateway_pb2.GenerationResult
    sent_s: float  # time.monotonic() when it was sent


@dataclass
class Workload:
    """Conversations sharing system prompts; `seed` makes its tokens unlike other runs'."""

    seed: int
    finished_hashes: set[int] = field(default_factory=set)
    served: list[Served] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        rng = random.Random(self.seed)
        self.systems = [[rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)] for _ in range(NUM_SYSTEM_PROMPTS)]
        self.users = [
            (self.systems[u % NUM_SYSTEM_PROMPTS], [[rng.randrange(VOCAB) for _ in range(TURN_TOKENS)]
                                                     for _ in range(NUM_TURNS)])
            for u in range(NUM_USERS)
        ]

    def ideal(self, prompt: list[int]) -> int:
        blocks = 0
        for block_hash in chain_block_hashes(prompt, BLOCK, HASH_SEED)[: (len(prompt) - 1) // BLOCK]:
            if block_hash not in self.finished_hashes:
                break
            blocks += 1
        return blocks * BLOCK

    def converse(self, stub, user: int) -> None:
        system, turns = self.users[user]
        prompt = list(system)
        for turn in turns:
            prompt = prompt + turn
            with self.lock:
                ideal = self.ideal(prompt)
            sent_s = time.monotonic()
            response = generate(stub, prompt, max_tokens=TURN_MAX_TOKENS)
            with self.lock:
                self.finished_hashes.update(chain_block_hashes(prompt, BLOCK, HASH_SEED))
                self.served.append(Served(prompt, ideal, response.result, sent_s))

    def run(self, address: str) -> None:
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(address))
        order = list(range(NUM_USERS))
        random.Random(self.seed).shuffle(order)
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            list(pool.map(lambda user: self.converse(stub, user), order))

    def cached(self) -> int:
        return sum(s.result.usage.cached_tokens for s in self.served)

    def ideal_total(self) -> int:
        return sum(s.ideal_tokens for s in self.served)

    def history(self, tokens_of) -> int:
        return sum(max(0, tokens_of(s) - SYSTEM_TOKENS) for s in self.served)



def generate(stub, prompt: list[int], timeout_s: float = 300.0, **sampling) -> gateway_pb2.GenerateResponse:
    params = gateway_pb2.GenerateParams(
        prompt_token_ids=common_pb2.TokenIdsInput(token_ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=sampling.pop("max_tokens", 1), temperature=0.0, **sampling),
    )
    return stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=timeout_s)


def history_ratios(workload: Workload) -> tuple[float, float]:
    """(all cached tokens, history cached tokens) as shares of the ideal."""
    ideal_history = workload.history(lambda s: s.ideal_tokens)
    cached_history = workload.history(lambda s: s.result.usage.cached_tokens)
    return workload.cached() / workload.ideal_total(), cached_history / ideal_history


def test_kv_routing_reuses_what_round_robin_recomputes(stack):
    ratios = {}
    for seed, policy in enumerate(("kv", "round-robin"), start=1):
        gateway = start_gateway(stack, f"gateway-{policy}", "--routing", policy)
        try:
            workload = Workload(seed)
            workload.run(gateway.address)
        finally:
            assert stop_service(gateway) == 0, gateway.log_tail()
        ratios[policy] = history_ratios(workload)
        if policy == "kv":
            predicted = sum(s.result.routing.predicted_cached_tokens for s in workload.served)
            assert abs(predicted - workload.cached()) <= 0.1 * workload.cached(), (predicted, workload.cached())
    print("cached/ideal (all, history):", ratios)
    assert ratios["kv"][0] >= 0.9 and ratios["kv"][1] >= 0.9, ratios
    assert ratios["round-robin"][1] <= 1.5 / NUM_REPLICAS, ratios


# --- Redis -----------------------------------------------------------------------------------


def redis_client(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url, socket_timeout=2)


def wait_until(condition, timeout_s: float, message: str) -> float:
    """Seconds it took for `condition()` to hold."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, message
        time.sleep(0.05)
    return time.monotonic() - started


def indexed_replicas(redis_server) -> set[str]:
    try:
        return {member.decode() for member in redis_client(redis_server).smembers(f"{KEY_PREFIX}:replicas")}
    except redis.ConnectionError:
        return set()


def test_kv_routing_through_redis(stack, redis_server):
    wait_until(lambda: indexed_replicas(redis_server) == {f"r{i}" for i in range(NUM_REPLICAS)}, 10,
               "every replica publishes to Redis")
    gateway = start_gateway(stack, "gateway-redis", "--redis-url", redis_server.url, "--redis-key-prefix",
                            KEY_PREFIX, "--redis-timeout-ms", "200")
    try:
        workload = Workload(seed=3)
        workload.run(gateway.address)
    finally:
        assert stop_service(gateway) == 0, gateway.log_tail()
    all_ratio, history_ratio = history_ratios(workload)
    assert all_ratio >= 0.9 and history_ratio >= 0.9, (all_ratio, history_ratio)


def test_redis_down_every_request_completes_and_the_index_rebuilds(stack, redis_server):
    gateway = start_gateway(stack, "gateway-redis-down", "--redis-url", redis_server.url, "--redis-key-prefix",
                            KEY_PREFIX, "--redis-timeout-ms", "200")
    try:
        workload = Workload(seed=4)
        run = threading.Thread(target=workload.run, args=(gateway.address,))
        run.start()
        wait_until(lambda: len(workload.served) >= 10, 60, "the workload runs")
        redis_server.kill()
        killed_s = time.monotonic()
        run.join(120)
        assert not run.is_alive()
        assert len(workload.served) == NUM_USERS * NUM_TURNS  # none failed (a failure ends its thread)
        # Routing went on on load alone: nothing was predicted for a request sent once Redis was
        # gone (one routed before the kill may finish after requests sent later).
        after = [s.result.routing.predicted_cached_tokens for s in workload.served if s.sent_s > killed_s]
        assert after and not any(after), after
        redis_server.start()  # empty
        took_s = wait_until(lambda: indexed_replicas(redis_server) == {f"r{i}" for i in range(NUM_REPLICAS)}, 10,
                            "the replicas republish their snapshots")
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gateway.address))
        again = generate(stub, workload.served[-1].prompt)
        assert again.result.routing.predicted_cached_tokens > 0
        assert again.result.usage.cached_tokens == again.result.routing.predicted_cached_tokens
        print(f"index rebuilt {took_s:.2f}s after Redis came back")
    finally:
        if redis_server.process is None:
            redis_server.start()
        assert stop_service(gateway) == 0, gateway.log_tail()


# --- replicas that die or hang ---------------------------------------------------------------


def replica_of(stack, replica_id: str):
    return stack["replicas"][int(replica_id.removeprefix("r"))]


def long_request(stub, prompt: list[int]):
    """A streaming request that generates for seconds (ignore_eos, to the context's end)."""
    params = gateway_pb2.GenerateParams(
        prompt_token_ids=common_pb2.TokenIdsInput(token_ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=256 - len(prompt), temperature=0.0, ignore_eos=True),
    )
    return stub.GenerateStream(gateway_pb2.GenerateStreamRequest(params=params), timeout=600)


def running_on(stack) -> list[int]:
    """Index of each replica with a request running."""
    loads = [inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(r.address)).GetLoad(
        inference_pb2.GetLoadRequest(), timeout=5) for r in stack["replicas"] if r.poll() is None]
    return [i for i, load in enumerate(loads) if load.num_running]


def start_on_a_known_replica(stub, seed: int):
    """Warm a prompt, then start a long request extending it: kv routing sends it where the
    prompt is cached. (replica id, the prompt, the long request's stream, its first message)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(3 * BLOCK)]
    victim = generate(stub, prompt).result.routing.replica_id
    stream = long_request(stub, prompt + [1, 2, 3])
    first = next(stream)
    return victim, prompt, stream, first


def assert_ends_unavailable(stream) -> str:
    """The stream's UNAVAILABLE details."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert info.value.details().startswith("inference unavailable: "), info.value.details()
    return info.value.details()


def test_a_hung_replica_stops_taking_requests_and_its_in_flight_ones_end_unavailable(stack):
    gateway = start_gateway(stack, "gateway-hang")
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gateway.address))
    try:
        victim, prompt, stream, _ = start_on_a_known_replica(stub, seed=5)
        hung = replica_of(stack, victim)
        hung.send_signal(signal.SIGSTOP)
        try:
            # Ended by the gateway's liveness watcher, which fails a replica's requests only once
            # it has been silent past its heartbeat TTL (a hung process keeps its connections
            # open: nothing else would end the stream before its 600 s deadline).
            details = assert_ends_unavailable(stream)
            assert details == f"inference unavailable: replica at {hung.address} stopped answering", details
            moved = generate(stub, prompt)
            assert moved.result.routing.replica_id != victim
            assert moved.result.routing.predicted_cached_tokens == 0  # its entries left with it
        finally:
            hung.send_signal(signal.SIGCONT)
    finally:
        assert stop_service(gateway) == 0, gateway.log_tail()


def test_a_killed_replica_leaves_both_indexes_and_its_in_flight_requests_end_unavailable(stack, redis_server):
    gateway = start_gateway(stack, "gateway-kill")
    sweeper = start_gateway(stack, "gateway-kill-redis", "--redis-url", redis_server.url, "--redis-key-prefix",
                            KEY_PREFIX)
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gateway.address))
    try:
        wait_until(lambda: indexed_replicas(redis_server) == {f"r{i}" for i in range(NUM_REPLICAS)}, 10,
                   "every replica is in Redis (again)")
        victim, prompt, stream, _ = start_on_a_known_replica(stub, seed=6)
        replica_of(stack, victim).kill()
        assert_ends_unavailable(stream)
        time.sleep(4 * HEARTBEAT_MS / 1000)
        for _ in range(NUM_REPLICAS):
            moved = generate(stub, prompt)
            assert moved.result.routing.replica_id != victim
            assert moved.result.routing.predicted_cached_tokens in (0, 2 * BLOCK)  # 0, then where it ran
        # The Redis sweeper drops it once its liveness key expired (TTL, plus a sweep interval).
        took_s = wait_until(lambda: victim not in indexed_replicas(redis_server), 4 * HEARTBEAT_MS / 1000 + 2.5,
                            "the sweeper drops the killed replica")
        assert not redis_client(redis_server).exists(f"{KEY_PREFIX}:replica:{victim}:blocks")
        print(f"swept {took_s:.2f}s after the kill")
    finally:
        for service in (gateway, sweeper):
            assert stop_service(service) == 0, service.log_tail()

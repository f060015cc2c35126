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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
import redis

from llmserve.block_hash import chain_block_hashes
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.procs import start_service, stop_service
from tests.redis_server import RedisServer

NUM_REPLICAS = 3
BLOCK = 16
VOCAB = 400  # below the tiny tokenizer's vocabulary
HEARTBEAT_MS = 100  # the replicas' heartbeat; their TTL is 4 intervals
KEY_PREFIX = "{test-routing}"
SYSTEM_TOKENS = 2 * BLOCK
TURN_TOKENS = 2 * BLOCK
NUM_SYSTEM_PROMPTS = 3
NUM_TURNS = 3
NUM_CLIENTS = 6
NUM_USERS = 24
# Tight bound so the balance is visible on a small run.
BALANCE_FLAGS = ["--routing-load-ratio", "1.5", "--routing-load-slack", "1"]


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.kill()


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
        for block_hash in chain_block_hashes(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]:
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
            response = generate(stub, prompt)
            with self.lock:
                self.finished_hashes.update(chain_block_hashes(prompt, BLOCK))
                self.served.append(Served(prompt, ideal, response.result))

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

    def requests_per_replica(self) -> Counter:
        return Counter(s.result.routing.replica_id for s in self.served)


def generate(stub, prompt: list[int], timeout_s: float = 60.0, **sampling) -> gateway_pb2.GenerateResponse:
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
        gateway = start_gateway(stack, f"gateway-{policy}", "--routing", policy, *BALANCE_FLAGS)
        try:
            workload = Workload(seed)
            workload.run(gateway.address)
        finally:
            assert stop_service(gateway) == 0, gateway.log_tail()
        ratios[policy] = history_ratios(workload)
        if policy == "kv":
            per_replica = workload.requests_per_replica()
            assert set(per_replica) == {f"r{i}" for i in range(NUM_REPLICAS)}
            assert max(per_replica.values()) <= 1.5 * min(per_replica.values()), per_replica
            predicted = sum(s.result.routing.predicted_cached_tokens for s in workload.served)
            assert abs(predicted - workload.cached()) <= 0.1 * workload.cached(), (predicted, workload.cached())
    print("cached/ideal (all, history):", ratios)
    assert ratios["kv"][0] >= 0.9 and ratios["kv"][1] >= 0.9, ratios
    assert ratios["round-robin"][1] <= 1.5 / NUM_REPLICAS, ratios

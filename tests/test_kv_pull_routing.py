"""KV pull chosen by the gateway's router, through a real gateway and two CPU replicas
(issue 22): replica A holds a prefix and is busy past the load bound; the gateway sends the
next request with that prefix to replica B with a hint to pull it from A. B's greedy tokens are
those of recomputing the prompt, the result says what was pulled and from whom, and nothing is
left in /dev/shm afterwards.
"""

from __future__ import annotations

import grpc
import pytest

from llmserve.tools.service_process import start_service, stop_service
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.factories import with_context
from tests.test_kv_pull_service import BLOCK_SIZE, our_segments, process_tree
from tests.test_torch_engine import make_prompt
from tests.transport_peers import wait_until

HEARTBEAT_MS = 50
NUM_NEW_TOKENS = 12
BUSY_TOKENS = 2000  # A's one long request: A stays past the load bound while the test routes
HEARTBEATS_TO_CATCH_UP = 6  # the gateway's stream of A's events runs beside ours
RPC_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    model_dir = with_context(tiny_model_dir, tmp_path_factory.mktemp("kv-pull-routing-model"), BUSY_TOKENS + 256)
    log_dir = tmp_path_factory.mktemp("kv-pull-routing-logs")
    model = ["--model", str(model_dir)]
    started = {}
    try:
        started["preprocess"] = start_service("preprocess", model, log_dir)
        for name in ("a", "b"):
            started[name] = start_service(f"inference-{name}", [
                *model, "--replica-id", name, "--kv-pull", "--num-kv-blocks", "400",
                "--kv-events-heartbeat-ms", str(HEARTBEAT_MS),
            ], log_dir, module="llmserve.inference")
        started["gateway"] = start_service("gateway", [
            *model, "--preprocess", started["preprocess"].address, "--inference", started["a"].address,
            "--inference", started["b"].address, "--routing-kv-pull", "--routing-load-slack", "0",
            "--routing-load-ratio", "1", "--heartbeat-interval-ms", str(HEARTBEAT_MS),
        ], log_dir, module="llmserve.gateway")
        pids = set().union(*(process_tree(started[name].process.pid) for name in ("a", "b")))
        yield started
    finally:
        for service in reversed(list(started.values())):
            stop_service(service)
    assert wait_until(lambda: not our_segments(pids)), our_segments(pids)


def inference_stub(service) -> inference_pb2_grpc.InferenceServiceStub:
    return inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(service.address))


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate_on(stub, name: str, prompt: list[int], cache_salt: str = "") -> list[int]:
    request = inference_pb2.GenerateTokensRequest(
        request_id=name, prompt_token_ids=prompt, sampling=greedy(NUM_NEW_TOKENS), cache_salt=cache_salt
    )
    return [token for response in stub.GenerateTokens(request, timeout=RPC_TIMEOUT_S) for token in response.token_ids]


def wait_for_load_seen(stub) -> None:
    """Until A's own event stream has said it runs a request, and a few heartbeats more."""
    events = stub.WatchKvEvents(inference_pb2.WatchKvEventsRequest(heartbeat_interval_ms=HEARTBEAT_MS))
    try:
        num_busy_heartbeats = 0
        for batch in events:
            num_busy_heartbeats += batch.load.num_running >= 1
            if num_busy_heartbeats >= HEARTBEATS_TO_CATCH_UP:
                return
    finally:
        events.cancel()


def test_the_router_sends_a_busy_holder_s_prefix_to_the_other_replica_which_pulls_it(stack):
    a, b = inference_stub(stack["a"]), inference_stub(stack["b"])
    gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack["gateway"].address))
    prefix = make_prompt(6 * BLOCK_SIZE, seed=41)
    generate_on(a, "prefix-on-a", prefix + [5, 6, 7])  # A holds the prefix's 6 blocks
    busy = a.GenerateTokens(inference_pb2.GenerateTokensRequest(
        request_id="busy", prompt_token_ids=make_prompt(10, seed=42), sampling=greedy(BUSY_TOKENS)
    ), timeout=RPC_TIMEOUT_S)
    try:
        next(busy)  # running on A
        wait_for_load_seen(a)
        prompt = prefix + make_prompt(24, seed=43)
        params = gateway_pb2.GenerateParams(
            prompt_token_ids=common_pb2.TokenIdsInput(token_ids=prompt), sampling=greedy(NUM_NEW_TOKENS),
            return_token_ids=True,
        )
        response = gateway.Generate(gateway_pb2.GenerateRequest(params=params), timeout=RPC_TIMEOUT_S)
    finally:
        busy.cancel()
    routing, usage = response.result.routing, response.result.usage
    assert (routing.replica_id, routing.pull_source_replica_id) == ("b", "a")
    assert (usage.cached_tokens, usage.pulled_tokens) == (6 * BLOCK_SIZE, 6 * BLOCK_SIZE)
    assert list(response.token_ids) == generate_on(b, "recomputed-on-b", prompt, cache_salt="recompute")

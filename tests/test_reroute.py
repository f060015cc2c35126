"""A request a replica refuses at admission goes to another replica (docs/routing.md, "Scoring").

Real stack on the default torch backend: preprocess, two replicas of the tiny model with a
4k context and small KV pools, a round-robin gateway (so requests do reach the full replica).
A long generation fills one replica's admission budget: short requests the router sends there
are refused RESOURCE_EXHAUSTED and served by the other, the client sees no error. With both
full, the client gets RESOURCE_EXHAUSTED with a retry hint; cancelled, both pools empty.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from llmserve.tools.service_process import start_service, stop_service
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.factories import with_context
from tests.metrics_scrape import scrape
from tests.procs import free_port
from tests.rich_status import retry_delay_ms

CONTEXT_TOKENS = 4096
BLOCK_TOKENS = 16
PROMPT_TOKENS = 16
# The long request needs (16 + 4000) / 16 = 251 blocks at its full length, a short one
# (16 + 40) / 16 = 4: a pool of 254 admits one long and no short request beside it.
LONG_MAX_TOKENS = 4000  # with ignore_eos: seconds of generation on the tiny model
SHORT_MAX_TOKENS = 40
NUM_KV_BLOCKS = 254
NUM_SHORT = 4
WAIT_TIMEOUT_S = 60.0
REFUSED = "RESOURCE_EXHAUSTED"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    model_dir = with_context(tiny_model_dir, tmp_path_factory.mktemp("tiny-llama-4k"), CONTEXT_TOKENS)
    log_dir = tmp_path_factory.mktemp("reroute-logs")
    model = ["--model", str(model_dir)]
    started = []
    try:
        started.append(start_service("preprocess", model, log_dir))
        replicas = {}
        for replica_id in ("r0", "r1"):
            metrics_port = free_port()
            replica = start_service(
                f"inference-{replica_id}",
                [*model, "--replica-id", replica_id, "--num-kv-blocks", str(NUM_KV_BLOCKS),
                 "--kv-overcommit", "1", "--metrics-port", str(metrics_port)],
                log_dir, module="llmserve.inference",
            )
            started.append(replica)
            replicas[replica_id] = (replica, metrics_port)
        gateway_metrics_port = free_port()
        inference_args = [arg for replica, _ in replicas.values() for arg in ("--inference", replica.address)]
        gateway = start_service(
            "gateway",
            [*model, "--preprocess", started[0].address, *inference_args, "--routing", "round-robin",
             "--metrics-port", str(gateway_metrics_port)],
            log_dir, module="llmserve.gateway",
        )
        started.append(gateway)
        yield {"gateway": gateway, "gateway_metrics_port": gateway_metrics_port, "replicas": replicas}
    finally:
        for service in reversed(started):
            stop_service(service)


def token_params(first_id: int, max_tokens: int) -> gateway_pb2.GenerateParams:
    return gateway_pb2.GenerateParams(
        prompt_token_ids=common_pb2.TokenIdsInput(token_ids=list(range(first_id, first_id + PROMPT_TOKENS))),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


class LongGeneration:
    """A long stream read on a thread (a client that reads: the gateway keeps it), until cancelled."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayServiceStub, first_id: int):
        self._call = stub.GenerateStream(gateway_pb2.GenerateStreamRequest(params=token_params(first_id, LONG_MAX_TOKENS)))
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self) -> None:
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass  # cancelled

    def cancel(self) -> None:
        self._call.cancel()
        self._thread.join()


def load_of(replica) -> inference_pb2.GetLoadResponse:
    with grpc.insecure_channel(replica.address) as channel:
        return inference_pb2_grpc.InferenceServiceStub(channel).GetLoad(inference_pb2.GetLoadRequest(), timeout=10)


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


def running_replica(stack) -> str | None:
    running = [rid for rid, (replica, _) in stack["replicas"].items() if load_of(replica).num_running]
    return running[0] if running else None


def refused_at(stack, replica_id: str) -> float:
    return scrape(stack["replicas"][replica_id][1]).value("llmserve_inference_admissions_refused_total", reason=REFUSED)


def test_a_refused_request_is_served_by_another_replica_and_refused_only_when_all_are_full(stack):
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack["gateway"].address))
    gateway_before = scrape(stack["gateway_metrics_port"])
    refused_before = {rid: refused_at(stack, rid) for rid in stack["replicas"]}

    first = LongGeneration(stub, first_id=10)
    second = None
    try:
        full = wait_for(lambda: running_replica(stack), "the long request runs")
        (other,) = set(stack["replicas"]) - {full}

        for i in range(NUM_SHORT):
            response = stub.Generate(gateway_pb2.GenerateRequest(params=token_params(100 + 20 * i, SHORT_MAX_TOKENS)), timeout=60)
            assert response.result.routing.replica_id == other
            assert response.result.usage.completion_tokens == SHORT_MAX_TOKENS

        # Round-robin sent some of them to the full replica first; each of its refusals was routed on.
        rerouted = scrape(stack["gateway_metrics_port"]).delta(gateway_before, "llmserve_routing_reroutes_total", replica=full)
        assert rerouted >= 1
        assert refused_at(stack, full) - refused_before[full] == rerouted
        assert refused_at(stack, other) == refused_before[other]

        second = LongGeneration(stub, first_id=200)
        wait_for(lambda: load_of(stack["replicas"][other][0]).num_running == 1, "the second long request runs")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(gateway_pb2.GenerateRequest(params=token_params(300, SHORT_MAX_TOKENS)), timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        assert "replica busy" in refused.value.details()
        assert retry_delay_ms(refused.value) > 0
        after = scrape(stack["gateway_metrics_port"])
        assert after.delta(gateway_before, "llmserve_gateway_request_errors_total", code=REFUSED) == 1
    finally:
        first.cancel()
        if second is not None:
            second.cancel()

    for replica, _ in stack["replicas"].values():
        wait_for(lambda: load_of(replica).kv_blocks_used == 0, f"{replica.address} frees every KV block")
    assert stop_service(stack["gateway"]) == 0

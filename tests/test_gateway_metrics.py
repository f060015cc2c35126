"""The gateway's /metrics after real requests: real preprocess, inference (torch, tiny model) and
gateways as processes, scraped over HTTP.

Each test reads the counters before and after its requests and asserts they moved by what the
requests' own results say (usage, timings, routing), exactly.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmserve.tools.service_process import ServiceProcess, launch_service, stop_service
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.metrics_scrape import Scrape, scrape
from tests.procs import running_service

POLL_TIMEOUT_S = 30.0
BLOCK = 16
GREEDY = dict(temperature=0.0)
# The tiny model's context is 256 tokens: a request for 240 with ignore_eos runs for hundreds of
# engine steps, so a client that cancels after its first message cancels it mid-generation.
LONG_MAX_TOKENS = 240
NUM_WORKERS = 2
MAX_CHANNELS = 64  # channels opened until requests ran on every worker (all on one: 2 ** -63)
# Each channel its own connection: SO_REUSEPORT spreads connections over the workers.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def metrics_url(service: ServiceProcess) -> str:
    """The /metrics address a service started with --metrics-port 0 logged."""
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while (found := re.search(r"metrics on (http://\S+/metrics)", service.log_path.read_text())) is None:
        assert time.monotonic() < deadline, f"no metrics address in the log:\n{service.log_tail()}"
        time.sleep(0.05)
    return found.group(1)


def scrape_when(url: str, condition) -> Scrape:
    """Scrape until `condition(samples)`: a stream's outcome is counted as its handler ends, just
    after the client has its last message."""
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not condition(samples := scrape(url)):
        assert time.monotonic() < deadline, "the metrics never reached the expected values"
        time.sleep(0.05)
    return samples


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.delta(before, name, **labels)


def gateway_name(suffix: str) -> str:
    return f"llmserve_gateway_{suffix}"


def routing_name(suffix: str) -> str:
    return f"llmserve_routing_{suffix}"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """Preprocess and two inference replicas (r0, r1), loading at once."""
    log_dir = tmp_path_factory.mktemp("gateway-metrics-logs")
    model = ["--model", str(tiny_model_dir)]
    started = [launch_service("preprocess", model, log_dir)]
    try:
        for replica_id in ("r0", "r1"):
            started.append(launch_service(
                f"inference-{replica_id}",
                [*model, "--replica-id", replica_id, "--num-kv-blocks", "256", "--metrics-port", "0"],
                log_dir, module="llmserve.inference",
            ))
        for service in started:
            service.wait_until_serving(180.0)
        yield {"preprocess": started[0], "replicas": started[1:], "log_dir": log_dir, "model": model}
    finally:
        for service in reversed(started):
            stop_service(service)


def running_gateway(stack, name: str, replicas, *flags: str):
    inference = [arg for replica in replicas for arg in ("--inference", replica.address)]
    return running_service(
        name,
        [*stack["model"], "--preprocess", stack["preprocess"].address, *inference, "--metrics-port", "0", *flags],
        stack["log_dir"], module="llmserve.gateway",
    )


@pytest.fixture(scope="module")
def gateway(stack):
    """One worker in front of r0: (its stub, its /metrics address)."""
    with running_gateway(stack, "gateway", stack["replicas"][:1]) as service:
        yield gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(service.address)), metrics_url(service)


def text_params(prompt: str, *, return_token_ids: bool = False, **sampling) -> gateway_pb2.GenerateParams:
    return gateway_pb2.GenerateParams(
        prompt=prompt, sampling=common_pb2.SamplingParams(**GREEDY, **sampling), return_token_ids=return_token_ids
    )


def token_params(token_ids: list[int], **sampling) -> gateway_pb2.GenerateParams:
    return gateway_pb2.GenerateParams(
        prompt_token_ids=common_pb2.TokenIdsInput(token_ids=token_ids),
        sampling=common_pb2.SamplingParams(**GREEDY, **sampling),
    )


def generate(stub, params: gateway_pb2.GenerateParams) -> gateway_pb2.GenerationResult:
    return stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=60.0).result


def generate_stream(stub, params: gateway_pb2.GenerateParams) -> gateway_pb2.GenerationResult:
    return list(stub.GenerateStream(gateway_pb2.GenerateStreamRequest(params=params), timeout=60.0))[-1].result


def requests_ended(samples: Scrape) -> float:
    return sum(
        samples.value(gateway_name("requests_total"), finish_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    )


def test_finished_and_refused_requests_move_every_counter_by_their_usage_and_timings(gateway):
    stub, url = gateway
    probe = stub.Generate(gateway_pb2.GenerateRequest(
        params=text_params("Hello", max_tokens=3, ignore_eos=True, return_token_ids=True)
    ))
    before = scrape(url)
    # Stops on a token inference generates (greedy: the probe's third), by Generate; stops on
    # length, by GenerateStream; refused by preprocess (max_tokens over the context).
    stopped = generate(stub, text_params("Hello", max_tokens=8, stop_token_ids=[probe.token_ids[2]]))
    at_length = generate_stream(stub, text_params("Hello world", max_tokens=5, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as refused:
        generate(stub, text_params("Hello", max_tokens=100_000))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape_when(url, lambda samples: requests_ended(samples) == requests_ended(before) + 3)

    finished = [stopped, at_length]
    assert [r.finish_reason for r in finished] == [common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH]
    for reason, count in (("stop", 1), ("length", 1), ("abort", 0), ("error", 1)):
        assert moved(before, after, gateway_name("requests_total"), finish_reason=reason) == count, reason
    assert moved(before, after, gateway_name("request_errors_total"), code="INVALID_ARGUMENT") == 1
    assert moved(before, after, gateway_name("client_disconnects_total")) == 0
    assert after.value(gateway_name("streams_in_flight")) == 0
    for name, field in (("prompt", "prompt_tokens"), ("completion", "completion_tokens"),
                        ("cached_prompt", "cached_tokens")):
        assert moved(before, after, gateway_name(f"{name}_tokens_total")) == sum(
            getattr(r.usage, field) for r in finished
        ), name
    # Every histogram counted each finished request, with the timings its result reports.
    for name, field in (("time_to_first_token", "time_to_first_token_ns"), ("e2e_request_latency", "total_time_ns"),
                        ("request_queue_time", "queue_time_ns"), ("request_preprocess_time", "preprocess_time_ns")):
        assert moved(before, after, gateway_name(f"{name}_seconds_count")) == 2, name
        assert moved(before, after, gateway_name(f"{name}_seconds_sum")) == pytest.approx(
            sum(getattr(r.timings, field) for r in finished) / 1e9, abs=1e-6
        ), name
    # One gap per token after each request's first; together they span first to last token (zero
    # when a loaded machine coalesced every token into the first message).
    assert moved(before, after, gateway_name("inter_token_latency_seconds_count")) == sum(
        r.usage.completion_tokens - 1 for r in finished
    )
    e2e_after_first = sum(r.timings.total_time_ns - r.timings.time_to_first_token_ns for r in finished) / 1e9
    assert 0 <= moved(before, after, gateway_name("inter_token_latency_seconds_sum")) <= e2e_after_first + 1e-6
    # One replica: routed by load, nothing predicted.
    assert moved(before, after, routing_name("decisions_total"), replica="r0", reason="load") == 2
    assert moved(before, after, routing_name("predicted_cached_tokens_total"), replica="r0") == 0
    assert moved(before, after, routing_name("actual_cached_tokens_total"), replica="r0") == sum(
        r.usage.cached_tokens for r in finished
    )
    assert after.value(routing_name("replicas_live")) == 1


def test_the_gateway_relays_prompts_to_inference_as_token_id_bytes(stack, gateway):
    stub, _ = gateway
    replica_url = metrics_url(stack["replicas"][0])
    before = scrape(replica_url)
    by_text = generate(stub, text_params("Hello there", max_tokens=2, return_token_ids=True))
    by_ids = generate(stub, token_params([5, 6, 7, 8], max_tokens=2))
    after = scrape(replica_url)
    prompts_received = "llmserve_inference_prompts_received_total"
    assert moved(before, after, prompts_received, encoding="token_id_bytes") == 2
    assert moved(before, after, prompts_received, encoding="token_ids") == 0
    assert (by_text.usage.prompt_tokens > 0, by_ids.usage.prompt_tokens) == (True, 4)


def test_a_client_cancel_is_a_disconnect_and_an_abort(gateway):
    stub, url = gateway
    before = scrape(url)
    stream = stub.GenerateStream(
        gateway_pb2.GenerateStreamRequest(params=text_params("Hello", max_tokens=LONG_MAX_TOKENS, ignore_eos=True))
    )
    assert next(stream).text is not None
    assert scrape(url).value(gateway_name("streams_in_flight")) == 1
    assert stream.cancel()
    after = scrape_when(url, lambda samples: requests_ended(samples) == requests_ended(before) + 1)
    assert moved(before, after, gateway_name("requests_total"), finish_reason="abort") == 1
    assert moved(before, after, gateway_name("client_disconnects_total")) == 1
    assert moved(before, after, gateway_name("request_errors_total"), code="CANCELLED") == 0
    assert after.value(gateway_name("streams_in_flight")) == 0
    # It had a first token, and no result: no usage, no e2e latency.
    assert moved(before, after, gateway_name("time_to_first_token_seconds_count")) == 1
    assert moved(before, after, gateway_name("e2e_request_latency_seconds_count")) == 0
    assert moved(before, after, gateway_name("completion_tokens_total")) == 0


def test_a_passed_deadline_is_an_error_not_a_disconnect(gateway):
    stub, url = gateway
    before = scrape(url)
    params = text_params("Hello", max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(gateway_pb2.GenerateStreamRequest(params=params), timeout=0.3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Refused by the replica's admission (it predicted the miss) or cancelled at the deadline: the same count.
    after = scrape_when(url, lambda samples: requests_ended(samples) == requests_ended(before) + 1)
    assert moved(before, after, gateway_name("requests_total"), finish_reason="error") == 1
    assert moved(before, after, gateway_name("request_errors_total"), code="DEADLINE_EXCEEDED") == 1
    assert moved(before, after, gateway_name("client_disconnects_total")) == 0
    assert after.value(gateway_name("streams_in_flight")) == 0


def generate_on_own_channel(address: str, params: gateway_pb2.GenerateParams) -> tuple[str, gateway_pb2.GenerationResult]:
    """One request on a connection of its own: the worker that served it, its result."""
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        response, call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate.with_call(
            gateway_pb2.GenerateRequest(params=params), timeout=60.0
        )
        return dict(call.initial_metadata())["x-gateway-worker"], response.result


def test_two_workers_serve_their_sum_at_the_parent(stack):
    with running_gateway(stack, "gateway-workers", stack["replicas"][:1], "--workers", str(NUM_WORKERS)) as service:
        url = metrics_url(service)
        before = scrape(url)
        params = text_params("Hello", max_tokens=3, ignore_eos=True)
        served: list[tuple[str, gateway_pb2.GenerationResult]] = []
        with ThreadPoolExecutor(max_workers=4) as pool:
            while len({worker for worker, _ in served}) < NUM_WORKERS and len(served) < MAX_CHANNELS:
                served += pool.map(lambda _: generate_on_own_channel(service.address, params), range(4))
        assert len({worker for worker, _ in served}) == NUM_WORKERS
        after = scrape_when(url, lambda samples: requests_ended(samples) == requests_ended(before) + len(served))
        assert moved(before, after, gateway_name("requests_total"), finish_reason="length") == len(served)
        assert moved(before, after, gateway_name("completion_tokens_total")) == 3 * len(served)
        for worker in map(str, range(NUM_WORKERS)):  # each worker's share, as x-gateway-worker said
            num_served = sum(1 for served_by, _ in served if served_by == worker)
            assert moved(before, after, gateway_name("worker_completion_tokens_total"), worker=worker) == 3 * num_served
        assert moved(before, after, gateway_name("e2e_request_latency_seconds_count")) == len(served)
        assert moved(before, after, routing_name("decisions_total"), replica="r0", reason="load") == len(served)
        # Gauges: in flight adds up over the workers (none now); each worker sees the one replica.
        assert after.value(gateway_name("streams_in_flight")) == 0
        assert after.value(routing_name("replicas_live")) == 1


def test_kv_routing_counts_its_decisions_and_the_cached_tokens_per_replica(stack):
    prompt = list(range(10, 10 + 3 * BLOCK + 1))  # three full blocks and a token
    with running_gateway(stack, "gateway-routing", stack["replicas"]) as service:
        url = metrics_url(service)
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(service.address))
        before = scrape(url)
        assert before.value(routing_name("replicas_live")) == 2
        # The first request finds nothing; a later one finds the prompt where the first ran, once
        # that replica's events have reached the gateway.
        results = [generate(stub, token_params(prompt, max_tokens=2))]
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while results[-1].routing.predicted_cached_tokens == 0:
            assert time.monotonic() < deadline, "the first request's blocks never reached the gateway's index"
            time.sleep(0.1)
            results.append(generate(stub, token_params(prompt, max_tokens=2)))
        after = scrape_when(url, lambda samples: requests_ended(samples) == requests_ended(before) + len(results))
    holder = results[0].routing.replica_id
    assert results[-1].routing == gateway_pb2.RoutingInfo(replica_id=holder, predicted_cached_tokens=3 * BLOCK)
    assert results[-1].usage.cached_tokens == 3 * BLOCK
    num_by_prefix = sum(r.routing.predicted_cached_tokens > 0 for r in results)
    for replica in ("r0", "r1"):
        mine = [r for r in results if r.routing.replica_id == replica]
        num_mine_by_prefix = sum(r.routing.predicted_cached_tokens > 0 for r in mine)
        assert moved(before, after, routing_name("decisions_total"), replica=replica, reason="prefix") == (
            num_mine_by_prefix
        ), replica
        assert moved(before, after, routing_name("decisions_total"), replica=replica, reason="fallback") == (
            len(mine) - num_mine_by_prefix
        ), replica
        assert moved(before, after, routing_name("predicted_cached_tokens_total"), replica=replica) == sum(
            r.routing.predicted_cached_tokens for r in mine
        ), replica
        assert moved(before, after, routing_name("actual_cached_tokens_total"), replica=replica) == sum(
            r.usage.cached_tokens for r in mine
        ), replica
    assert moved(before, after, routing_name("fallbacks_total"), cause="no_match") == len(results) - num_by_prefix
    assert moved(before, after, routing_name("fallbacks_total"), cause="imbalance") == 0

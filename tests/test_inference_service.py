"""The Inference service over real gRPC: an in-process server on port 0 and a subprocess."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY

from llmserve import token_id_bytes
from llmserve.block_hash import HASH_VERSION, fingerprint
from llmserve.gateway.inference_client import InferenceClient
from llmserve.gateway.preprocess_client import PreparedPrompt
from llmserve.inference.backends import create_engine
from llmserve.inference.engine.cores import BackendUnavailable, create_engine_core
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.hf_engine import HFEngineCore
from llmserve.inference.engine.types import EngineRequest
from llmserve.inference.kv_event_log import KvEventLog
from llmserve.inference.servicer import SERVICE_NAME, InferenceServicer
from llmserve.message_limits import token_ids_request_bytes
from llmserve.pb import region_ids_to_pb, scope_to_pb
from llmserve.prompt_ids_region import PromptIdsRing, local_scope
from llmserve.sampling import SamplingParams
from llmserve.server import CHANNEL_OPTIONS, RunningServer, create_server
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.rich_status import field_violation, is_refused_at_admission

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [5, 17, 42, 99, 100, 7, 250, 31]
CONTEXT_TOKENS = 256  # the tiny checkpoint's max_position_embeddings
HANG_GUARD_S = 30.0
# A request that runs for seconds on the tiny model: 16 sequences (run one after another by the
# hf backend) of up to the whole context each.
LONG_SAMPLING = common_pb2.SamplingParams(max_tokens=CONTEXT_TOKENS - len(PROMPT), ignore_eos=True, n=16)


def hf_config(model_dir) -> EngineConfig:
    return EngineConfig(model_path=model_dir, model_name="tiny", backend="hf")


@dataclass
class Service:
    running: RunningServer
    engine: AsyncEngine
    channel: grpc.aio.Channel
    stub: inference_pb2_grpc.InferenceServiceStub


async def start_service(model_dir) -> Service:
    engine = AsyncEngine(EngineThread(HFEngineCore(hf_config(model_dir))))
    await engine.start()
    servicer = InferenceServicer(engine, KvEventLog.of(engine, replica_id="replica-under-test"))
    running = await create_server(
        "127.0.0.1:0",
        lambda server: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        max_receive_bytes=token_ids_request_bytes(
            engine.model_info.max_context_tokens, engine.model_info.block_size_tokens
        ),
    )
    await running.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", options=CHANNEL_OPTIONS)
    return Service(running, engine, channel, inference_pb2_grpc.InferenceServiceStub(channel))


async def stop_service(service: Service) -> None:
    await service.channel.close()
    await service.engine.shutdown(drain_timeout_s=0.0)
    await service.running.server.stop(0)


@pytest.fixture(scope="module")
async def service(tiny_model_dir):
    service = await start_service(tiny_model_dir)
    yield service
    await stop_service(service)


@pytest.fixture(scope="module")
def vocab_size(service) -> int:
    return service.engine.model_info.vocab_size


def generate_request(request_id: str, prompt=PROMPT, **sampling) -> inference_pb2.GenerateTokensRequest:
    return inference_pb2.GenerateTokensRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)
    )


async def read_all(call) -> list[inference_pb2.GenerateTokensResponse]:
    """The rest of a stream (read API: tests also call call.read() before this)."""

    async def consume():
        responses = []
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
        return responses

    return await asyncio.wait_for(consume(), HANG_GUARD_S)


async def wait_for_load(stub, predicate) -> inference_pb2.GetLoadResponse:
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        load = await stub.GetLoad(inference_pb2.GetLoadRequest())
        if predicate(load):
            return load
        assert time.monotonic() < deadline, f"load never reached the condition: {load}"
        await asyncio.sleep(0.01)


def direct_outputs(model_dir, request: EngineRequest):
    core = HFEngineCore(hf_config(model_dir))
    core.add_request(request)
    outputs = []
    while core.has_requests_in_flight():
        outputs += core.step()
    return outputs


@pytest.mark.parametrize(
    "sampling",
    [
        dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=99, n=2, ignore_eos=True),
    ],
    ids=["greedy-logprobs", "seeded-n2"],
)
async def test_streaming_generate_matches_the_engine_core(service, tiny_model_dir, sampling):
    responses = await read_all(service.stub.GenerateTokens(generate_request("match", **sampling)))
    expected = direct_outputs(
        tiny_model_dir, EngineRequest("match", PROMPT, SamplingParams(**sampling), time.monotonic_ns())
    )
    # A slow reader gets coalesced messages: compare each sequence's tokens and logprobs whole.
    for index in range(sampling.get("n", 1)):
        got_messages = [r for r in responses if r.sequence_index == index]
        want_outputs = [o for o in expected if o.sequence_index == index]
        assert [t for r in got_messages for t in r.token_ids] == [t for o in want_outputs for t in o.new_token_ids]
        got_logprobs = [lp for r in got_messages for lp in r.logprobs]
        want_logprobs = [lp for o in want_outputs for lp in o.logprobs or []]
        assert [lp.token_id for lp in got_logprobs] == [lp.token_id for lp in want_logprobs]
        for got, want in zip(got_logprobs, want_logprobs):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
            assert [t.token_id for t in got.top_logprobs] == [t.token_id for t in want.top_logprobs]
        assert [r.HasField("usage") for r in got_messages] == [False] * (len(got_messages) - 1) + [True]
    finals = [r for r in responses if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
    assert [(r.sequence_index, r.finish_reason) for r in finals] == [
        (i, common_pb2.FINISH_REASON_LENGTH) for i in range(sampling.get("n", 1))
    ]
    for r in finals:
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens) == (
            8, sampling["max_tokens"], 0,
        )
        assert not r.HasField("stop_token_id")
        assert r.timings.total_time_ns >= r.timings.time_to_first_token_ns > 0


async def test_stop_token_id_is_reported(service):
    [first] = await read_all(service.stub.GenerateTokens(generate_request("probe", max_tokens=1, temperature=0.0)))
    stop_id = first.token_ids[0]
    responses = await read_all(
        service.stub.GenerateTokens(generate_request("stop", max_tokens=9, temperature=0.0, stop_token_ids=[stop_id]))
    )
    [last] = responses
    assert (list(last.token_ids), last.finish_reason, last.stop_token_id) == (
        [stop_id], common_pb2.FINISH_REASON_STOP, stop_id,
    )


def _invalid_cases(vocab_size: int):
    too_long_prompt = [1] * CONTEXT_TOKENS
    return [
        (generate_request("", max_tokens=4), "request_id: must not be empty"),
        (generate_request("x", prompt=[], max_tokens=4), "prompt_token_ids: must not be empty"),
        (
            generate_request("x", prompt=[1, 2, vocab_size, 3], max_tokens=4),
            f"prompt_token_ids[2]: token id {vocab_size} is not below the vocab size {vocab_size}",
        ),
        (
            generate_request("x", prompt=too_long_prompt, max_tokens=4),
            "prompt_token_ids: 256 tokens leave no room to generate: the context is 256 tokens, so at most 255",
        ),
        (
            generate_request("x", max_tokens=249),
            "sampling.max_tokens: 249 tokens do not fit: the prompt has 8 tokens and the context is 256, "
            "so at most 248",
        ),
        (generate_request("x", max_tokens=0), "sampling.max_tokens: must be at least 1, got 0"),
        (generate_request("x", temperature=-1.0), "sampling.temperature: must be in [0, 100], got -1"),
        (generate_request("x", top_p=0.0), "sampling.top_p: must be in (0, 1], got 0"),
        (generate_request("x", n=17), "sampling.n: must be in [1, 16], got 17"),
        (generate_request("x", logprobs=21), "sampling.logprobs: at most 20, got 21"),
        (
            generate_request("x", max_tokens=4, stop_token_ids=[2, vocab_size + 7]),
            f"sampling.stop_token_ids[1]: token id {vocab_size + 7} is not below the vocab size {vocab_size}",
        ),
        (
            generate_request("x", temperature=0.0),
            "sampling.max_tokens: must be set (preprocess resolves it for the prompt); at most 248 for this prompt",
        ),
        (
            hashed_request(block_size_tokens=0),
            "block_size_tokens: must be this replica's block size of 16 tokens when block_hashes are given, got 0",
        ),
        (
            hashed_request(block_size_tokens=32),
            "block_size_tokens: must be this replica's block size of 16 tokens when block_hashes are given, got 32",
        ),
        (
            hashed_request(block_hash_version=HASH_VERSION + 1),
            f"block_hash_version: must be this replica's version {HASH_VERSION} when block_hashes are given, "
            f"got {HASH_VERSION + 1}",
        ),
        (
            hashed_request(block_hashes=[1, 2]),
            "block_hashes: 2 hashes but the prompt has only 1 full blocks of 16 tokens",
        ),
    ]


def bytes_request(prompt_token_id_bytes: bytes, **fields) -> inference_pb2.GenerateTokensRequest:
    """The prompt as the gateway sends it: token_id_bytes."""
    return inference_pb2.GenerateTokensRequest(
        request_id="x", prompt_token_id_bytes=prompt_token_id_bytes, sampling=common_pb2.SamplingParams(max_tokens=4),
        **fields,
    )


def _invalid_bytes_cases(vocab_size: int):
    return [
        (
            bytes_request(token_id_bytes.pack(PROMPT), prompt_token_ids=PROMPT),
            "prompt_token_id_bytes: set either it or prompt_token_ids, not both",
        ),
        (
            bytes_request(token_id_bytes.pack(PROMPT)[:-1]),
            "prompt_token_id_bytes: 31 bytes is not a whole number of token ids (4 bytes each, little-endian)",
        ),
        (
            bytes_request(token_id_bytes.pack([1, 2, vocab_size, 3])),
            f"prompt_token_id_bytes[2]: token id {vocab_size} is not below the vocab size {vocab_size}",
        ),
        (
            bytes_request(token_id_bytes.pack([1] * CONTEXT_TOKENS)),
            "prompt_token_id_bytes: 256 tokens leave no room to generate: the context is 256 tokens, so at most 255",
        ),
        (
            bytes_request(b""),  # an empty bytes field is unset: the ids are looked for in prompt_token_ids
            "prompt_token_ids: must not be empty",
        ),
    ]


async def test_prompt_token_id_bytes_generate_what_the_ids_do(service):
    sampling = common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    as_ids = await read_all(service.stub.GenerateTokens(
        inference_pb2.GenerateTokensRequest(request_id="ids", prompt_token_ids=PROMPT, sampling=sampling)
    ))
    as_bytes = await read_all(service.stub.GenerateTokens(
        inference_pb2.GenerateTokensRequest(
            request_id="bytes", prompt_token_id_bytes=token_id_bytes.pack(PROMPT), sampling=sampling
        )
    ))
    assert [t for r in as_bytes for t in r.token_ids] == [t for r in as_ids for t in r.token_ids]
    assert [lp.logprob for r in as_bytes for lp in r.logprobs] == [lp.logprob for r in as_ids for lp in r.logprobs]
    assert as_bytes[-1].usage.prompt_tokens == len(PROMPT)
    for request, message in _invalid_bytes_cases(service.engine.model_info.vocab_size):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await read_all(service.stub.GenerateTokens(request))
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        field, problem = field_violation(error.value)
        assert message == f"{field}: {problem}"


async def test_prompt_ids_in_a_ring_generate_what_the_ids_do_and_a_bad_reference_is_refused(service, vocab_size):
    ring = PromptIdsRing(4096, lease_s=30.0)
    try:
        ref = ring.put(token_id_bytes.pack(PROMPT))
        sampling = common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
        as_ids = await read_all(service.stub.GenerateTokens(generate_request("ids", **_fields(sampling))))
        in_ring = await read_all(service.stub.GenerateTokens(region_request(ref, sampling=sampling)))
        assert [t for r in in_ring for t in r.token_ids] == [t for r in as_ids for t in r.token_ids]
        assert [lp.logprob for r in in_ring for lp in r.logprobs] == [lp.logprob for r in as_ids for lp in r.logprobs]
        assert in_ring[-1].usage.prompt_tokens == len(PROMPT)
        out_of_vocab = ring.put(token_id_bytes.pack([1, 2, vocab_size, 3]))
        for request, code, message in _invalid_region_cases(ref, out_of_vocab, vocab_size):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await read_all(service.stub.GenerateTokens(request))
            assert (error.value.code(), error.value.details()) == (code, message)
    finally:
        ring.close()


def _fields(sampling: common_pb2.SamplingParams) -> dict:
    return {name.name: value for name, value in sampling.ListFields()}


def region_request(ref, **fields) -> inference_pb2.GenerateTokensRequest:
    """The prompt as the gateway relays a long one: a reference into preprocess's ring."""
    fields.setdefault("sampling", common_pb2.SamplingParams(max_tokens=4))
    return inference_pb2.GenerateTokensRequest(request_id="x", prompt_token_ids_in_region=region_ids_to_pb(ref), **fields)


def _invalid_region_cases(ref, out_of_vocab, vocab_size: int):
    field, invalid = "prompt_token_ids_in_region", grpc.StatusCode.INVALID_ARGUMENT
    return [
        (region_request(ref, prompt_token_ids=PROMPT), invalid,
         f"{field}: set either it, prompt_token_ids or prompt_token_id_bytes, not two"),
        (region_request(dataclasses.replace(ref, region_name="../../etc/passwd")), invalid,
         f"{field}: '../../etc/passwd' is not a prompt-ids ring's name (llmserve-ids-<pid>-<12 hex digits>)"),
        (region_request(dataclasses.replace(ref, offset_bytes=4088)), invalid,
         f"{field}: an entry of 8 ids at 4088 ends past the ring's 4096 bytes"),
        (region_request(dataclasses.replace(ref, num_ids=CONTEXT_TOKENS)), invalid,
         f"{field}: 256 tokens leave no room to generate: the context is 256 tokens, so at most 255"),
        (region_request(out_of_vocab), invalid,
         f"{field}[2]: token id {vocab_size} is not below the vocab size {vocab_size}"),
        (region_request(dataclasses.replace(ref, key=ref.key ^ 1)), grpc.StatusCode.FAILED_PRECONDITION,
         f"{field}: the entry at 16 of {ref.region_name} holds another prompt now (its lease ran out before it "
         "was read)"),
    ]


def hashed_request(**fields) -> inference_pb2.GenerateTokensRequest:
    """A 20-token prompt (one full block of 16) with one block hash, as preprocess sends it."""
    request = inference_pb2.GenerateTokensRequest(
        request_id="x",
        prompt_token_ids=list(range(1, 21)),
        sampling=common_pb2.SamplingParams(max_tokens=4),
        block_hashes=[1],
        block_size_tokens=16,
        block_hash_version=HASH_VERSION,
    )
    for name, value in fields.items():
        if name == "block_hashes":
            request.block_hashes[:] = value
        else:
            setattr(request, name, value)
    return request


async def test_invalid_requests_get_precise_invalid_argument(service, vocab_size):
    for request, message in _invalid_cases(vocab_size):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await read_all(service.stub.GenerateTokens(request))
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        field, problem = field_violation(error.value)
        assert message == f"{field}: {problem}"
    load = await service.stub.GetLoad(inference_pb2.GetLoadRequest())  # still healthy
    assert (load.num_running, load.num_waiting) == (0, 0)


async def test_duplicate_in_flight_request_id(service):
    call = service.stub.GenerateTokens(
        inference_pb2.GenerateTokensRequest(request_id="dup", prompt_token_ids=PROMPT, sampling=LONG_SAMPLING)
    )
    await asyncio.wait_for(call.read(), HANG_GUARD_S)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await read_all(service.stub.GenerateTokens(generate_request("dup", max_tokens=2)))
    assert (error.value.code(), error.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "request_id: 'dup' is already in flight",
    )
    call.cancel()
    await wait_for_load(service.stub, lambda load: load.num_running == 0 and load.num_waiting == 0)


async def test_client_cancel_aborts_the_request(service):
    before = await service.stub.GetLoad(inference_pb2.GetLoadRequest())
    call = service.stub.GenerateTokens(
        inference_pb2.GenerateTokensRequest(request_id="cancel-me", prompt_token_ids=PROMPT, sampling=LONG_SAMPLING)
    )
    for _ in range(3):
        await asyncio.wait_for(call.read(), HANG_GUARD_S)
    call.cancel()
    load = await wait_for_load(
        service.stub, lambda load: load.num_aborted_total == before.num_aborted_total + 1
    )
    assert (load.num_running, load.num_waiting) == (0, 0)


async def test_deadline_exceeded_aborts_the_request(service):
    before = await service.stub.GetLoad(inference_pb2.GetLoadRequest())
    call = service.stub.GenerateTokens(
        inference_pb2.GenerateTokensRequest(request_id="too-slow", prompt_token_ids=PROMPT, sampling=LONG_SAMPLING),
        timeout=0.3,
    )
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await read_all(call)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # refused by admission (it predicted the miss: never admitted), or admitted and aborted
    num_aborts = 0 if is_refused_at_admission(error.value.details()) else 1
    load = await wait_for_load(
        service.stub, lambda load: load.num_aborted_total == before.num_aborted_total + num_aborts
    )
    assert (load.num_running, load.num_waiting) == (0, 0)


async def test_abort_rpc(service):
    unknown = await service.stub.Abort(inference_pb2.AbortRequest(request_id="nobody"))
    assert unknown.was_running is False
    call = service.stub.GenerateTokens(
        inference_pb2.GenerateTokensRequest(request_id="abort-me", prompt_token_ids=PROMPT, sampling=LONG_SAMPLING)
    )
    await asyncio.wait_for(call.read(), HANG_GUARD_S)
    aborted = await service.stub.Abort(inference_pb2.AbortRequest(request_id="abort-me"))
    again = await service.stub.Abort(inference_pb2.AbortRequest(request_id="abort-me"))
    assert (aborted.was_running, again.was_running) == (True, False)
    rest = await read_all(call)  # the stream ends normally, each unfinished sequence CANCELLED
    assert await call.code() == grpc.StatusCode.OK
    cancelled = [r.sequence_index for r in rest if r.finish_reason == common_pb2.FINISH_REASON_CANCELLED]
    assert cancelled == list(range(16))
    await wait_for_load(service.stub, lambda load: load.num_running == 0)


async def test_get_model_info(service, vocab_size, tiny_model_dir):
    info = await service.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    assert info == inference_pb2.GetModelInfoResponse(
        model=common_pb2.ModelInfo(
            model_name="tiny",
            architecture="LlamaForCausalLM",
            max_context_tokens=CONTEXT_TOKENS,
            vocab_size=vocab_size,
            eos_token_ids=[2],
            block_size_tokens=16,
            dtype="float32",
            backend="hf",
            device="cpu",
            block_hash_version=HASH_VERSION,
            model_fingerprint=fingerprint((tiny_model_dir / "config.json").read_bytes()),
            tokenizer_fingerprint=fingerprint((tiny_model_dir / "tokenizer.json").read_bytes()),
        ),
        replica_id="replica-under-test",
        takes_prompt_token_id_bytes=True,
        takes_prompt_token_ids_in_region=True,
        shared_memory=scope_to_pb(local_scope()),
    )


async def test_get_load_names_the_replica(service):
    load = await service.stub.GetLoad(inference_pb2.GetLoadRequest())
    assert (load.replica_id, load.kv_blocks_total, load.kv_blocks_used) == ("replica-under-test", 0, 0)


async def test_draining_refuses_new_requests_and_finishes_running_ones(tiny_model_dir):
    service = await start_service(tiny_model_dir)
    try:
        call = service.stub.GenerateTokens(generate_request("running", max_tokens=40, temperature=0.0, ignore_eos=True))
        first = await asyncio.wait_for(call.read(), HANG_GUARD_S)
        shutdown = asyncio.create_task(service.engine.shutdown(drain_timeout_s=HANG_GUARD_S))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await read_all(service.stub.GenerateTokens(generate_request("late", max_tokens=2)))
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.UNAVAILABLE, "the inference engine is shutting down",
        )
        rest = await read_all(call)
        # Tokens, not messages: a reader scheduled late gets several tokens in one message.
        assert sum(len(message.token_ids) for message in [first, *rest]) == 40
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        await asyncio.wait_for(shutdown, HANG_GUARD_S)
    finally:
        await stop_service(service)


async def test_create_engine_picks_the_backend(tiny_model_dir):
    assert isinstance(create_engine_core(hf_config(tiny_model_dir)), HFEngineCore)
    assert isinstance(create_engine(hf_config(tiny_model_dir)), AsyncEngine)


async def test_a_backend_that_cannot_be_loaded_is_named(tiny_model_dir):
    # TensorRT-LLM is not installed on CPU hosts.
    config = EngineConfig(model_path=tiny_model_dir, model_name="tiny", backend="trtllm")
    with pytest.raises(BackendUnavailable, match="^backend 'trtllm' is not available: "):
        create_engine(config)
    with pytest.raises(ValueError, match="^backend 'trtllm' runs its own engine, not an EngineCore"):
        create_engine_core(config)


# --- the real process -----------------------------------------------------------------------


async def _wait_for_port_file(process: subprocess.Popen, path) -> int:
    deadline = time.monotonic() + 120.0
    while not path.exists():
        assert process.poll() is None, f"server exited early with {process.returncode}"
        assert time.monotonic() < deadline, "server did not write its port file"
        await asyncio.sleep(0.05)
    return int(path.read_text())


# The drain must finish every in-flight token whatever the machine's load: the hf backend makes
# ~20 tokens/s on a loaded 2-core CPU, so 4 x 50 tokens need ~10 s against a 120 s grace period.
DRAIN_TOKENS = 50
DRAIN_GRACE_S = 120


@pytest.mark.parametrize("backend", ["torch", "hf"])
async def test_subprocess_serves_and_drains_on_sigterm(tiny_model_dir, tmp_path, backend):
    port_file = tmp_path / "port"
    log_path = tmp_path / "server.log"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "llmserve.inference", "--backend", backend, "--model", str(tiny_model_dir),
            "--model-name", "tiny", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
            "--grace-period-s", str(DRAIN_GRACE_S), "--log-level", "INFO",
        ],
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        port = await _wait_for_port_file(process, port_file)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            services = await _reflected_services(channel)
            assert "llmserve.v1.InferenceService" in services
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
            assert (info.model.backend, info.replica_id) == (backend, f"{socket.gethostname()}-{port}")

            sampling = common_pb2.SamplingParams(max_tokens=DRAIN_TOKENS, temperature=0.0, ignore_eos=True, n=4)
            call = stub.GenerateTokens(
                inference_pb2.GenerateTokensRequest(request_id="drain", prompt_token_ids=PROMPT, sampling=sampling)
            )
            first = await asyncio.wait_for(call.read(), HANG_GUARD_S)
            os.kill(process.pid, signal.SIGTERM)
            rest = await read_all(call)
        responses = [first, *rest]
        assert sum(len(r.token_ids) for r in responses) == 4 * DRAIN_TOKENS
        finals = [r.finish_reason for r in responses if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
        assert finals == [common_pb2.FINISH_REASON_LENGTH] * 4
        assert await asyncio.to_thread(process.wait, DRAIN_GRACE_S + 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log_text = log_path.read_text()
    assert f"backend={backend} device=cpu dtype=float32" in log_text
    assert "signal received: draining" in log_text


async def test_subprocess_with_an_unavailable_backend_exits_with_the_reason(tiny_model_dir, tmp_path):
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "llmserve.inference", "--backend", "trtllm", "--model", str(tiny_model_dir),
         "--port", "0", "--port-file", str(tmp_path / "port")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "backend 'trtllm' is not available: " in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "port").exists()


async def _reflected_services(channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for response in responses:
        return [s.name for s in response.list_services_response.service]
    return []


async def test_the_gateway_client_sends_bytes_once_the_replica_says_it_takes_them(service):
    client = InferenceClient(f"127.0.0.1:{service.running.port}")
    prompt = PreparedPrompt(token_id_bytes.pack(PROMPT), [], 16, HASH_VERSION, "", 6, 0)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def tokens_and_encodings(request_id: str) -> tuple[list[int], dict[str, float]]:
        before = _prompts_received()
        outputs = [output async for output in client.generate(request_id, prompt, greedy, timeout_s=HANG_GUARD_S)]
        after = _prompts_received()
        return [t for o in outputs for t in o.new_token_ids], {k: after[k] - before[k] for k in after}

    try:
        # Before the model card is read, the client cannot know the replica reads the bytes.
        unknown = await tokens_and_encodings("before-card")
        await client.get_model_card()
        known = await tokens_and_encodings("after-card")
    finally:
        await client.close()
    assert unknown[1] == {"token_ids": 1, "token_id_bytes": 0}
    assert known[1] == {"token_ids": 0, "token_id_bytes": 1}
    assert known[0] == unknown[0] and len(known[0]) == 6


def _prompts_received() -> dict[str, float]:
    """This process's replica counters (the in-process server's metrics are on its registry)."""
    return {
        encoding: REGISTRY.get_sample_value("llmserve_inference_prompts_received_total", {"encoding": encoding}) or 0.0
        for encoding in ("token_ids", "token_id_bytes")
    }

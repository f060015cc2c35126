"""The gateway against real preprocess and inference processes (torch and hf backends) on a tiny model.

The model is a copy of the tiny Llama with a 4096-token context, so that a request with
ignore_eos and a large max_tokens is still generating when the test cancels it, lets its
deadline pass or matches a stop string: those tests then see inference abort it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from llmserve.errors import UNAVAILABLE_RETRY_AFTER_MS
from llmserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    preprocess_pb2,
    preprocess_pb2_grpc,
)
from tests.factories import with_context
from tests.procs import running_stack, stack_fixture
from tests.rich_status import field_violation, is_refused_at_admission, retry_delay_ms

LONG_CONTEXT_TOKENS = 4096
LONG_MAX_TOKENS = 4000  # with ignore_eos: seconds of generation, so it is still running when stopped
POLL_TIMEOUT_S = 30.0

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return with_context(tiny_model_dir, tmp_path_factory.mktemp("tiny-llama-4k"), LONG_CONTEXT_TOKENS)


# The default data plane on each backend, and the torch backend with its core on a thread of the
# server (--no-core-process); each test runs on each stack in turn.
STACKS = {
    "torch": dict(backend="torch"),
    "hf": dict(backend="hf"),
    "torch-thread": dict(backend="torch", inference_args=["--no-core-process"]),
}
services = stack_fixture(model="model_dir", variants=STACKS, clean_exit=["gateway"])


@pytest.fixture(scope="module")
def gateway(services) -> gateway_pb2_grpc.GatewayServiceStub:
    return gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(services["gateway"].address))


@pytest.fixture(scope="module")
def inference(services) -> inference_pb2_grpc.InferenceServiceStub:
    return inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(services["inference"].address))


@pytest.fixture(scope="module")
def preprocess(services) -> preprocess_pb2_grpc.PreprocessServiceStub:
    return preprocess_pb2_grpc.PreprocessServiceStub(grpc.insecure_channel(services["preprocess"].address))


def prompt_params(prompt: str, *, return_token_ids: bool = False, **sampling) -> gateway_pb2.GenerateParams:
    return gateway_pb2.GenerateParams(
        prompt=prompt, sampling=common_pb2.SamplingParams(**sampling), return_token_ids=return_token_ids
    )


def chat_params(content: str, *, return_token_ids: bool = False, **sampling) -> gateway_pb2.GenerateParams:
    chat = common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content=content)])
    return gateway_pb2.GenerateParams(
        chat=chat, sampling=common_pb2.SamplingParams(**sampling), return_token_ids=return_token_ids
    )


def generate(gateway, params: gateway_pb2.GenerateParams, **kwargs) -> gateway_pb2.GenerateResponse:
    return gateway.Generate(gateway_pb2.GenerateRequest(params=params), **kwargs)


def start_stream(gateway, params: gateway_pb2.GenerateParams, **kwargs):
    return gateway.GenerateStream(gateway_pb2.GenerateStreamRequest(params=params), **kwargs)


def collect_stream(gateway, params, **kwargs) -> list[gateway_pb2.GenerateStreamResponse]:
    return list(start_stream(gateway, params, **kwargs))


def wait_for_load(inference, predicate) -> inference_pb2.GetLoadResponse:
    """Poll GetLoad until `predicate(load)`; fail with the last load after POLL_TIMEOUT_S."""
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while True:
        load = inference.GetLoad(inference_pb2.GetLoadRequest())
        if predicate(load):
            return load
        if time.monotonic() > deadline:
            pytest.fail(f"inference load never satisfied the condition; last: {load}")
        time.sleep(0.05)


def test_stream_and_unary_agree_greedy(gateway):
    for request in (
        prompt_params("The capital of France is", max_tokens=24, return_token_ids=True, **GREEDY),
        chat_params("Hi there", max_tokens=24, return_token_ids=True, **GREEDY),
    ):
        unary = generate(gateway, request)
        messages = collect_stream(gateway, request)
        assert "".join(m.text for m in messages) == unary.text
        assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
        final = messages[-1].result
        assert final.finish_reason == unary.result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == unary.result.usage.completion_tokens == 24
        assert final.usage.prompt_tokens == unary.result.usage.prompt_tokens
        assert all(not m.HasField("result") for m in messages[:-1])
        assert len({m.request_id for m in messages}) == 1
        assert messages[0].request_id != unary.request_id


def token_id_params(token_ids, *, return_token_ids: bool = False, **sampling) -> gateway_pb2.GenerateParams:
    return gateway_pb2.GenerateParams(
        prompt_token_ids=common_pb2.TokenIdsInput(token_ids=token_ids),
        sampling=common_pb2.SamplingParams(**sampling),
        return_token_ids=return_token_ids,
    )


def test_a_token_id_prompt_generates_what_its_text_does(gateway, preprocess):
    text = "The capital of France is"
    token_ids = list(preprocess.Tokenize(preprocess_pb2.TokenizeRequest(text=text)).token_ids)
    from_text = generate(gateway, prompt_params(text, max_tokens=16, return_token_ids=True, **GREEDY))
    by_ids = token_id_params(token_ids, max_tokens=16, return_token_ids=True, **GREEDY)

    from_ids = generate(gateway, by_ids)
    streamed = collect_stream(gateway, by_ids)

    assert list(from_ids.token_ids) == list(from_text.token_ids) and len(from_ids.token_ids) == 16
    assert from_ids.text == from_text.text == "".join(m.text for m in streamed)
    assert [t for m in streamed for t in m.token_ids] == list(from_text.token_ids)
    assert from_ids.result.usage.prompt_tokens == streamed[-1].result.usage.prompt_tokens == len(token_ids)


def test_concurrent_requests_keep_their_own_state(gateway):
    prompts = ["Hello", "The capital of France is", "def add(a, b):", "Continuous batching lets", "emoji 🙂", "0123"]
    requests = [prompt_params(p, max_tokens=12, return_token_ids=True, **GREEDY) for p in prompts]
    sequential = [generate(gateway, r) for r in requests]
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        concurrent = list(pool.map(lambda r: collect_stream(gateway, r), requests))
    for expected, messages in zip(sequential, concurrent, strict=True):
        assert "".join(m.text for m in messages) == expected.text
        assert [t for m in messages for t in m.token_ids] == list(expected.token_ids)
    assert len({r.request_id for r in sequential} | {m[0].request_id for m in concurrent}) == 2 * len(requests)


def test_request_id_is_minted_and_sent_as_metadata(gateway):
    request = gateway_pb2.GenerateRequest(params=prompt_params("Hello", max_tokens=2))
    response, call = gateway.Generate.with_call(request)
    assert len(response.request_id) == 32 and int(response.request_id, 16) >= 0
    assert dict(call.initial_metadata())["x-request-id"] == response.request_id

    stream = start_stream(gateway, prompt_params("Hello", max_tokens=2))
    messages = list(stream)
    assert dict(stream.initial_metadata())["x-request-id"] == messages[0].request_id


def test_return_token_ids_off_sends_text_only(gateway, preprocess):
    with_ids = generate(gateway, prompt_params("Hello", max_tokens=8, return_token_ids=True, **GREEDY))
    without = generate(gateway, prompt_params("Hello", max_tokens=8, **GREEDY))
    assert len(with_ids.token_ids) == 8
    assert list(without.token_ids) == []
    assert without.text == with_ids.text
    detokenized = preprocess.Detokenize(preprocess_pb2.DetokenizeRequest(token_ids=with_ids.token_ids))
    assert with_ids.text == detokenized.text
    for message in collect_stream(gateway, prompt_params("Hello", max_tokens=8, **GREEDY)):
        assert list(message.token_ids) == []


def test_usage_and_timings_are_consistent(gateway, preprocess):
    response = generate(gateway, prompt_params("The capital of France is", max_tokens=10, return_token_ids=True))
    prompt = preprocess.Tokenize(preprocess_pb2.TokenizeRequest(text="The capital of France is"))
    usage = response.result.usage
    assert usage.prompt_tokens == len(prompt.token_ids)
    assert usage.completion_tokens == len(response.token_ids) == 10
    assert usage.cached_tokens <= usage.prompt_tokens
    timings = response.result.timings
    assert timings.preprocess_time_ns > 0
    assert 0 < timings.time_to_first_token_ns <= timings.total_time_ns
    assert timings.queue_time_ns < timings.total_time_ns


def test_logprobs_are_passed_through(gateway):
    response = generate(gateway, prompt_params("Hello", max_tokens=5, return_token_ids=True, logprobs=2, **GREEDY))
    assert [lp.token_id for lp in response.logprobs] == list(response.token_ids)
    assert all(len(lp.top_logprobs) == 2 for lp in response.logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(lp.top_logprobs[0].token_id == lp.token_id for lp in response.logprobs)


def test_stop_string_truncates_and_aborts_inference(gateway, inference):
    reference = generate(gateway, 
        chat_params("Hi there", max_tokens=24, return_token_ids=True, ignore_eos=True, **GREEDY)
    )
    middle = len(reference.text) // 2
    stop = reference.text[middle : middle + 3]
    expected_text = reference.text[: reference.text.index(stop)]
    before = inference.GetLoad(inference_pb2.GetLoadRequest())

    request = chat_params(
        "Hi there", max_tokens=LONG_MAX_TOKENS, ignore_eos=True, stop=["never appears", stop],
        return_token_ids=True, **GREEDY,
    )
    messages = collect_stream(gateway, request)
    final = messages[-1].result
    assert "".join(m.text for m in messages) == expected_text
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert final.matched_stop == stop
    token_ids = [t for m in messages for t in m.token_ids]
    assert token_ids == list(reference.token_ids[: len(token_ids)])
    assert final.usage.completion_tokens == len(token_ids) < 24

    load = wait_for_load(
        inference, lambda load: load.num_running == 0 and load.num_aborted_total == before.num_aborted_total + 1
    )
    assert load.num_waiting == 0

    unary = generate(gateway, request)
    assert unary.text == expected_text
    assert unary.result.matched_stop == stop
    assert unary.result.finish_reason == common_pb2.FINISH_REASON_STOP


def test_n_sequences_stream_interleaved_and_agree_with_unary(gateway, inference):
    """sampling.n = 3: the stream carries each sequence's messages (sequence_index) and ends after
    each one's result; Generate returns them all in `sequences` (sequence 0 also at the top)."""
    request = prompt_params("Once upon a time", n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True,
                            return_token_ids=True)
    unary = generate(gateway, request)
    assert [sequence.sequence_index for sequence in unary.sequences] == [0, 1, 2]
    for sequence in unary.sequences:
        assert sequence.result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sequence.result.usage.completion_tokens == len(sequence.token_ids) == 10
    assert (unary.text, list(unary.token_ids), unary.result) == (
        unary.sequences[0].text, list(unary.sequences[0].token_ids), unary.sequences[0].result)
    assert len({tuple(sequence.token_ids) for sequence in unary.sequences}) > 1  # sampled, not copies

    messages = collect_stream(gateway, request)
    for sequence in unary.sequences:
        mine = [m for m in messages if m.sequence_index == sequence.sequence_index]
        assert "".join(m.text for m in mine) == sequence.text
        assert [t for m in mine for t in m.token_ids] == list(sequence.token_ids)
        assert [m.HasField("result") for m in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].result.usage.completion_tokens == 10
    assert {m.sequence_index for m in messages} == {0, 1, 2}
    wait_for_load(inference, lambda load: load.num_running == 0 and load.kv_blocks_used == 0)


def test_a_stop_string_ends_every_sequence_it_matches(gateway, inference):
    """Greedy n = 2: both sequences match the stop string at the same place; each ends with
    STOP and the text before it, and the request is aborted on inference once."""
    reference = generate(gateway, chat_params("Hi there", max_tokens=24, ignore_eos=True, **GREEDY))
    middle = len(reference.text) // 2
    stop = reference.text[middle : middle + 3]
    expected_text = reference.text[: reference.text.index(stop)]
    before = inference.GetLoad(inference_pb2.GetLoadRequest())
    request = chat_params("Hi there", n=2, max_tokens=LONG_MAX_TOKENS, ignore_eos=True, stop=[stop], **GREEDY)
    messages = collect_stream(gateway, request)
    for index in (0, 1):
        mine = [m for m in messages if m.sequence_index == index]
        assert "".join(m.text for m in mine) == expected_text
        assert mine[-1].result.finish_reason == common_pb2.FINISH_REASON_STOP
        assert mine[-1].result.matched_stop == stop
    wait_for_load(
        inference, lambda load: load.num_running == 0 and load.num_aborted_total == before.num_aborted_total + 1
    )


def test_stop_string_absent_keeps_full_text(gateway):
    reference = generate(gateway, prompt_params("Hello", max_tokens=12, **GREEDY))
    response = generate(gateway, prompt_params("Hello", max_tokens=12, stop=["\x00never"], **GREEDY))
    assert response.text == reference.text
    assert response.result.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert not response.result.HasField("matched_stop")


def assert_rpc_error(call, code: grpc.StatusCode, details_start: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert info.value.details().startswith(details_start), info.value.details()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        # The field travels as a structured BadRequest violation, the message is built from it.
        field, problem = field_violation(info.value)
        assert info.value.details() == f"{field}: {problem}"
    return info.value


INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_REQUESTS = [
    # From preprocess, passed through.
    (prompt_params(""), INVALID, "prompt: must not be empty"),
    (
        prompt_params("Hello", max_tokens=LONG_CONTEXT_TOKENS + 10),
        INVALID,
        "sampling.max_tokens: 4106 exceeds the server limit of 4095 output tokens",
    ),
    (
        gateway_pb2.GenerateParams(chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="robot")])),
        INVALID,
        "chat.messages[0].role: unknown role 'robot'",
    ),
    # From the gateway's own validation.
    (prompt_params("Hello", temperature=-1.0), INVALID, "sampling.temperature: must be in [0, 100], got -1"),
    (prompt_params("Hello", top_p=0.0), INVALID, "sampling.top_p: must be in (0, 1], got 0"),
    (prompt_params("Hello", max_tokens=0), INVALID, "sampling.max_tokens: must be at least 1, got 0"),
    (prompt_params("Hello", n=17), INVALID, "sampling.n: must be in [1, 16], got 17"),
    (gateway_pb2.GenerateParams(), INVALID, "input: set one of prompt, chat or prompt_token_ids"),
    (token_id_params([]), INVALID, "prompt_token_ids.token_ids: must not be empty"),
    (
        token_id_params([1, 2, 1_000_000]),
        INVALID,
        "prompt_token_ids.token_ids[2]: 1000000 is outside the vocabulary of ",
    ),
    (
        token_id_params([5] * LONG_CONTEXT_TOKENS),
        INVALID,
        f"prompt_token_ids: {LONG_CONTEXT_TOKENS} tokens leaves no room for output in the model context",
    ),
    (
        gateway_pb2.GenerateParams(model="other", prompt="Hello"),
        grpc.StatusCode.NOT_FOUND,
        "model: unknown model 'other'",
    ),
]


def test_a_preprocess_field_is_renamed_to_the_client_field_in_the_details(gateway):
    error = assert_rpc_error(
        lambda: generate(gateway, prompt_params("Hello", max_tokens=LONG_CONTEXT_TOKENS + 10)), INVALID, "sampling."
    )
    # Preprocess names it max_tokens; the client set sampling.max_tokens.
    assert field_violation(error) == ("sampling.max_tokens", "4106 exceeds the server limit of 4095 output tokens")


@pytest.mark.parametrize(("params", "code", "details_start"), BAD_REQUESTS)
def test_bad_requests_get_precise_statuses(gateway, params, code, details_start):
    assert_rpc_error(lambda: generate(gateway, params), code, details_start)
    assert_rpc_error(lambda: collect_stream(gateway, params), code, details_start)
    # The gateway still serves.
    assert generate(gateway, prompt_params("Hello", max_tokens=2)).result.usage.completion_tokens == 2


def test_client_cancel_aborts_inference(gateway, inference):
    before = inference.GetLoad(inference_pb2.GetLoadRequest())
    request = prompt_params("Hello", max_tokens=LONG_MAX_TOKENS, ignore_eos=True, return_token_ids=True)
    stream = start_stream(gateway, request)
    first = next(stream)
    assert len(first.token_ids) >= 1
    assert stream.cancel()
    load = wait_for_load(
        inference, lambda load: load.num_running == 0 and load.num_aborted_total == before.num_aborted_total + 1
    )
    assert load.num_finished_total >= before.num_finished_total
    # Nothing leaked: the next request runs normally.
    assert generate(gateway, prompt_params("Hello", max_tokens=3)).result.usage.completion_tokens == 3


def expected_aborts(error: grpc.RpcError) -> int:
    """A request whose deadline passes is either refused by the replica's admission (it predicted
    the miss: nothing was ever admitted) or admitted and then aborted: 0 or 1 aborts."""
    return 0 if is_refused_at_admission(error.details()) else 1


@pytest.mark.parametrize(
    ("call", "return_token_ids"),
    [
        pytest.param(lambda gateway, request: list(start_stream(gateway, request, timeout=2.0)), True, id="stream"),
        pytest.param(lambda gateway, request: generate(gateway, request, timeout=2.0), False, id="unary"),
    ],
)
def test_client_deadline_is_exceeded_and_inference_aborts(gateway, inference, call, return_token_ids):
    before = inference.GetLoad(inference_pb2.GetLoadRequest())
    request = prompt_params("Hello", max_tokens=LONG_MAX_TOKENS, ignore_eos=True, return_token_ids=return_token_ids)
    with pytest.raises(grpc.RpcError) as info:
        call(gateway, request)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    num_aborts = expected_aborts(info.value)
    wait_for_load(
        inference,
        lambda load: load.num_running == 0 and load.num_aborted_total == before.num_aborted_total + num_aborts,
    )


def test_list_models(gateway, inference):
    info = inference.GetModelInfo(inference_pb2.GetModelInfoRequest())
    response = gateway.ListModels(gateway_pb2.ListModelsRequest())
    assert list(response.models) == [
        common_pb2.ModelInfo(
            model_name=info.model.model_name,
            architecture="LlamaForCausalLM",
            max_context_tokens=LONG_CONTEXT_TOKENS,
            eos_token_ids=info.model.eos_token_ids,
            backend=info.model.backend,
        )
    ]
    # The listed name is accepted as GenerateParams.model.
    params = prompt_params("Hello", max_tokens=2)
    params.model = response.models[0].model_name
    assert generate(gateway, params).result.usage.completion_tokens == 2


def test_inference_down_is_unavailable(services, model_dir, tmp_path):
    """A second gateway whose inference replica dies: UNAVAILABLE naming inference."""
    with running_stack(model_dir, tmp_path, backend="hf", preprocess=services["preprocess"],
                       clean_exit=["gateway"]) as second:
        second["inference"].kill()
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(second["gateway"].address))
        request = prompt_params("Hello", max_tokens=2)
        unavailable = grpc.StatusCode.UNAVAILABLE
        for call in (lambda: generate(stub, request), lambda: collect_stream(stub, request)):
            error = assert_rpc_error(call, unavailable, "inference unavailable: ")
            assert retry_delay_ms(error) == UNAVAILABLE_RETRY_AFTER_MS


def test_a_cache_salt_shares_the_prefix_cache_only_with_the_same_salt(gateway, inference, services):
    if inference.GetModelInfo(inference_pb2.GetModelInfoRequest()).model.backend == "hf":
        pytest.skip("the hf backend has no prefix cache")
    token_ids = list(range(100, 140))  # 2 full blocks of 16 that no other test sends

    def num_cached_tokens(cache_salt: str) -> int:
        params = token_id_params(token_ids, max_tokens=2)
        params.cache_salt = cache_salt
        return generate(gateway, params).result.usage.cached_tokens

    assert [num_cached_tokens(salt) for salt in ("salt-a", "", "salt-b", "salt-a", "")] == [0, 0, 0, 32, 32]
    for service in services.values():
        assert "salt-a" not in service.log_path.read_text()

"""Hostile input against a real stack (gateway, preprocess, inference on the tiny model): a
long client value is never echoed whole (the status it gets is the precise one, short, with a
rich status that parses; no log line over the cap), and sampling fields that contradict each
other are refused at the gateway and at inference's door.

Preprocess runs with --max-prompt-bytes 1 MB, so that 100 KB values fit every receive limit (as
they do for a real model's context) and reach the check that refuses them; every service logs
JSON at DEBUG with --log-prompts, the most any line can carry.
"""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_status import rpc_status

from llmserve.block_hash import MAX_CACHE_SALT_BYTES
from llmserve.client_text import num_bytes
from llmserve.log_format import MAX_LINE_BYTES
from llmserve.request_context import MAX_REQUEST_ID_BYTES
from llmserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    preprocess_pb2,
    preprocess_pb2_grpc,
)
from tests.procs import running_service, running_stack
from tests.rich_status import field_violation

LOG_FLAGS = ["--log-format", "json", "--log-level", "DEBUG", "--log-prompts"]
LONG_LENGTHS = [9_000, 100_000]
# A quote is ~70 characters: a status about one stays far below this.
MAX_ECHO_CHARS = 300
CONTEXT_TOKENS = 256  # the tiny model's
MAX_UINT32 = 4294967295


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("hostile-input-logs")
    preprocess_args = ["--model", str(tiny_model_dir), *LOG_FLAGS, "--max-prompt-bytes", "1000000"]
    with running_service("preprocess", preprocess_args, log_dir) as preprocess:
        with running_stack(tiny_model_dir, log_dir, preprocess=preprocess, service_args=LOG_FLAGS) as services:
            yield services


@pytest.fixture(scope="module")
def gateway(stack):
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


@pytest.fixture(scope="module")
def preprocess(stack):
    with grpc.insecure_channel(stack["preprocess"].address) as channel:
        yield preprocess_pb2_grpc.PreprocessServiceStub(channel)


@pytest.fixture(scope="module")
def inference(stack):
    with grpc.insecure_channel(stack["inference"].address) as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)


def _refusal(call) -> grpc.RpcError:
    """The error `call` (which reads a stream to its end) fails with."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _generate(gateway, params: gateway_pb2.GenerateParams) -> gateway_pb2.GenerateResponse:
    return gateway.Generate(gateway_pb2.GenerateRequest(params=params), timeout=60)


def _stream(gateway, params: gateway_pb2.GenerateParams) -> list[gateway_pb2.GenerateStreamResponse]:
    return list(gateway.GenerateStream(gateway_pb2.GenerateStreamRequest(params=params), timeout=60))


def _chat(role: str) -> common_pb2.ChatInput:
    return common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role=role, content="hi")])


def _assert_short_status(error: grpc.RpcError, code: grpc.StatusCode, num_value_bytes: int) -> None:
    """`code`, a message naming the value's length, short, and the same message in a rich status
    that parses."""
    assert error.code() == code, error.details()[:500]
    details = error.details()
    assert len(details) <= MAX_ECHO_CHARS and f"({num_value_bytes} bytes)" in details, details
    status = rpc_status.from_call(error)
    assert status is not None and status.message == details


@pytest.mark.parametrize("length", LONG_LENGTHS)
@pytest.mark.parametrize("call", [_generate, _stream], ids=["unary", "stream"])
def test_a_long_model_name_is_not_found_named_by_its_length(gateway, call, length):
    params = gateway_pb2.GenerateParams(model="m" * length, prompt="hello")
    error = _refusal(lambda: call(gateway, params))
    _assert_short_status(error, grpc.StatusCode.NOT_FOUND, length)
    assert error.details().startswith("model: unknown model 'mmmm")


@pytest.mark.parametrize("length", [7_000, 100_000])
def test_a_long_role_is_invalid_argument_through_the_gateway(gateway, length):
    error = _refusal(lambda: _generate(gateway, gateway_pb2.GenerateParams(chat=_chat("r" * length))))
    _assert_short_status(error, grpc.StatusCode.INVALID_ARGUMENT, length)
    field, description = field_violation(error)
    assert field == "chat.messages[0].role" and description.startswith("unknown role 'rrrr")
    assert f"({length} bytes)" in description


@pytest.mark.parametrize("length", [7_000, 100_000])
def test_a_long_role_is_invalid_argument_at_preprocess(preprocess, length):
    request = preprocess_pb2.PreprocessRequest(request_id="long-role", chat=_chat("r" * length))
    error = _refusal(lambda: preprocess.Preprocess(request, timeout=60))
    _assert_short_status(error, grpc.StatusCode.INVALID_ARGUMENT, length)
    assert field_violation(error)[0] == "chat.messages[0].role"
    tokenize = _refusal(lambda: preprocess.Tokenize(preprocess_pb2.TokenizeRequest(chat=_chat("r" * length))))
    _assert_short_status(tokenize, grpc.StatusCode.INVALID_ARGUMENT, length)


def test_no_log_line_is_over_the_cap_after_long_values(stack, gateway, preprocess):
    role = "r" * 100_000
    for call in (
        lambda: _generate(gateway, gateway_pb2.GenerateParams(chat=_chat(role))),
        lambda: _generate(gateway, gateway_pb2.GenerateParams(model=role, prompt="hello")),
        lambda: preprocess.Preprocess(preprocess_pb2.PreprocessRequest(request_id=role, chat=_chat(role))),
    ):
        _refusal(call)
    sampling = common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
    still_serving = _generate(gateway, gateway_pb2.GenerateParams(prompt="still", sampling=sampling))
    assert still_serving.result.usage.completion_tokens == 2
    logs = {name: service.log_path.read_text().splitlines() for name, service in stack.items()}
    assert any(json.loads(text)["message"].startswith("rejected: ") for text in logs["preprocess"])
    for name, lines in logs.items():
        for text in lines:
            assert num_bytes(text) <= MAX_LINE_BYTES, f"{name}: a line of {num_bytes(text)} bytes: {text[:300]}"
            json.loads(text)  # still one object


def test_a_long_request_id_is_refused_at_preprocess_and_inference(preprocess, inference):
    request_id = "i" * 1000
    refused = [
        _refusal(lambda: preprocess.Preprocess(preprocess_pb2.PreprocessRequest(request_id=request_id, prompt="hi"))),
        _refusal(lambda: list(inference.GenerateTokens(inference_pb2.GenerateTokensRequest(
            request_id=request_id, prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=2))))),
    ]
    for error in refused:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(error) == (
            "request_id", f"1000 bytes exceeds the limit of {MAX_REQUEST_ID_BYTES} bytes"
        )



def test_a_long_cache_salt_is_refused_at_every_door_without_echoing_it(gateway, preprocess, inference):
    salt = "secret-" + "s" * 1000
    size = num_bytes(salt)
    refused = [
        _refusal(lambda: _generate(gateway, gateway_pb2.GenerateParams(
            prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2), cache_salt=salt))),
        _refusal(lambda: preprocess.Preprocess(preprocess_pb2.PreprocessRequest(
            request_id="long-salt", prompt="hi", cache_salt=salt))),
        _refusal(lambda: list(inference.GenerateTokens(inference_pb2.GenerateTokensRequest(
            request_id="long-salt", prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=2),
            cache_salt=salt)))),
    ]
    for error in refused:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert field_violation(error) == ("cache_salt", f"{size} bytes exceeds the limit of {MAX_CACHE_SALT_BYTES} bytes")
        assert "secret" not in error.details()
    assert _generate(gateway, gateway_pb2.GenerateParams(
        prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2, min_tokens=2), cache_salt="s" * MAX_CACHE_SALT_BYTES
    )).result.usage.completion_tokens == 2

# --- cross-field checks -------------------------------------------------------------------------


def test_min_tokens_over_max_tokens_is_refused_at_the_gateway(gateway):
    sampling = common_pb2.SamplingParams(max_tokens=8, min_tokens=MAX_UINT32)
    params = gateway_pb2.GenerateParams(prompt="hello", sampling=sampling)
    for call in (_generate, _stream):
        error = _refusal(lambda: call(gateway, params))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(error) == (
            "sampling.min_tokens", f"{MAX_UINT32} exceeds max_tokens 8; must be at most max_tokens"
        )


def test_min_tokens_over_the_context_is_refused_at_the_gateway_when_max_tokens_is_unset(gateway):
    params = gateway_pb2.GenerateParams(prompt="hello", sampling=common_pb2.SamplingParams(min_tokens=MAX_UINT32))
    error = _refusal(lambda: _generate(gateway, params))
    field, description = field_violation(error)
    assert field == "sampling.min_tokens"
    assert description == (
        f"{MAX_UINT32} exceeds the {CONTEXT_TOKENS - 1} tokens any request can generate in the model context "
        f"of {CONTEXT_TOKENS} tokens"
    )


def test_min_tokens_over_the_resolved_max_tokens_is_refused_by_inference(gateway, preprocess):
    """Within the context but beyond what preprocess resolves for this prompt: inference checks it."""
    num_prompt_tokens = len(preprocess.Tokenize(preprocess_pb2.TokenizeRequest(text="hello")).token_ids)
    sampling = common_pb2.SamplingParams(min_tokens=CONTEXT_TOKENS - 1)
    params = gateway_pb2.GenerateParams(prompt="hello", sampling=sampling)
    error = _refusal(lambda: _generate(gateway, params))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    resolved = CONTEXT_TOKENS - num_prompt_tokens
    assert field_violation(error) == (
        "sampling.min_tokens", f"{CONTEXT_TOKENS - 1} exceeds max_tokens {resolved}; must be at most max_tokens"
    )


def test_min_tokens_over_max_tokens_is_refused_at_inference_directly(inference):
    request = inference_pb2.GenerateTokensRequest(
        request_id="min-over-max", prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(max_tokens=8, min_tokens=MAX_UINT32),
    )
    error = _refusal(lambda: list(inference.GenerateTokens(request, timeout=60)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(error) == (
        "sampling.min_tokens", f"{MAX_UINT32} exceeds max_tokens 8; must be at most max_tokens"
    )


def test_min_tokens_equal_to_max_tokens_is_served(gateway):
    sampling = common_pb2.SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    response = _generate(gateway, gateway_pb2.GenerateParams(prompt="hello", sampling=sampling))
    assert response.result.usage.completion_tokens == 4

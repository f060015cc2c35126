"""Oversized prompts are refused before tokenization: over the byte cap, INVALID_ARGUMENT with the
field and the limit, at preprocess and through the gateway; over the receive-message limit sized
from the cap (llmserve.message_limits), grpc's RESOURCE_EXHAUSTED before any of our code runs,
on all three services. Every service keeps serving. Real servers (torch backend) on the tiny
model; the cap is derived from the context unless configured."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.message_limits import prompt_request_bytes, token_ids_request_bytes
from llmserve.preprocessing.tokenizer import ModelTokenizer
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from llmserve.v1 import preprocess_pb2, preprocess_pb2_grpc
from tests.procs import running_service, stack_fixture
from tests.rich_status import field_violation

TEN_MB = 10 * 1024 * 1024
CONTEXT = 256  # the tiny model's
GREEDY_2 = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


stack = stack_fixture()


@pytest.fixture(scope="module")
def info(stack) -> preprocess_pb2.GetPreprocessInfoResponse:
    with grpc.insecure_channel(stack["preprocess"].address) as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        return stub.GetPreprocessInfo(preprocess_pb2.GetPreprocessInfoRequest(), timeout=30)


def _preprocess(stack, request: preprocess_pb2.PreprocessRequest):
    with grpc.insecure_channel(stack["preprocess"].address) as channel:
        return preprocess_pb2_grpc.PreprocessServiceStub(channel).Preprocess(request, timeout=60)


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_a_prompt_over_the_cap_is_refused_untokenized_through_the_gateway(stack, info):
    num_bytes = info.max_prompt_bytes + 1000  # over the cap, under the receive limit
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        long = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="a" * num_bytes))
        error = _refusal(lambda: gateway.Generate(long, timeout=60))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(error) == (
            "prompt", f"{num_bytes} bytes exceeds the limit of {info.max_prompt_bytes} bytes; not tokenized"
        )
        normal = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="hello", sampling=GREEDY_2))
        assert gateway.Generate(normal, timeout=60).result.usage.completion_tokens == 2


def _assert_serving(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_an_oversized_message_is_refused_by_every_service_and_they_keep_serving(stack, info):
    prompt_limit = prompt_request_bytes(info.max_prompt_bytes, CONTEXT)
    huge_prompt = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="a " * (TEN_MB // 2)))
    huge_ids = inference_pb2.GenerateTokensRequest(request_id="huge", prompt_token_ids=[1] * (TEN_MB // 10))
    with grpc.insecure_channel(stack["gateway"].address) as gateway_channel, \
            grpc.insecure_channel(stack["inference"].address) as inference_channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
        inference = inference_pb2_grpc.InferenceServiceStub(inference_channel)
        refusals = {
            "gateway": (_refusal(lambda: gateway.Generate(huge_prompt, timeout=60)), prompt_limit),
            "preprocess": (
                _refusal(lambda: _preprocess(stack, preprocess_pb2.PreprocessRequest(prompt="a" * TEN_MB))),
                prompt_limit,
            ),
            "inference": (
                _refusal(lambda: list(inference.GenerateTokens(huge_ids, timeout=60))),
                token_ids_request_bytes(CONTEXT, info.model.block_size_tokens),
            ),
        }
        for service, (error, limit) in refusals.items():
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (service, error.details())
            assert f"bytes exceeds the limit of {limit} bytes for /llmserve.v1." in error.details(), service
            assert error.details().startswith("request: ") and error.details().endswith("; not parsed")
            _assert_serving(stack[service].address)
            log_text = stack[service].log_path.read_text()
            assert "rejected an oversized request to /llmserve.v1." in log_text and "Traceback" not in log_text
        normal = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="hello", sampling=GREEDY_2))
        assert gateway.Generate(normal, timeout=60).result.usage.completion_tokens == 2


def test_the_derived_cap_never_refuses_a_prompt_of_context_many_longest_tokens(stack, tiny_model_dir):
    tokenizer = ModelTokenizer.load(tiny_model_dir)
    longest = max((tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)),
                  key=lambda text: len(text.encode("utf-8")))
    prompt = longest * (CONTEXT - 1)
    assert len(prompt.encode("utf-8")) == (CONTEXT - 1) * tokenizer.max_token_bytes
    try:
        _preprocess(stack, preprocess_pb2.PreprocessRequest(request_id="long", prompt=prompt, max_tokens=1))
    except grpc.RpcError as error:  # too many tokens is allowed here; too many bytes is not
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "bytes" not in field_violation(error)[1], error.details()


def _chat_request(*turns: tuple[str, str]) -> preprocess_pb2.PreprocessRequest:
    messages = [common_pb2.ChatMessage(role=role, content=content) for role, content in turns]
    return preprocess_pb2.PreprocessRequest(request_id="r", chat=common_pb2.ChatInput(messages=messages))


def test_chat_turns_count_together(stack, info):
    quarter = "b" * (info.max_prompt_bytes // 4)
    error = _refusal(lambda: _preprocess(stack, _chat_request(*[("user", quarter)] * 4)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(error)[0] == "chat.messages"


def test_many_empty_turns_count_their_framing_and_their_rendered_text(stack, info):
    # Each ("user", "") turn counts 4 role bytes + 8 of framing: one turn too many for the cap...
    too_many = _refusal(lambda: _preprocess(stack, _chat_request(*[("user", "")] * (info.max_prompt_bytes // 12 + 1))))
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(too_many)[0] == "chat.messages"
    # ...while as many as fit the cap render (the template adds its markers per turn) to more.
    rendered = _refusal(lambda: _preprocess(stack, _chat_request(*[("user", "")] * (info.max_prompt_bytes // 12))))
    assert rendered.code() == grpc.StatusCode.INVALID_ARGUMENT
    field, problem = field_violation(rendered)
    assert field == "chat" and problem.endswith(f"exceeds the limit of {info.max_prompt_bytes} bytes; not tokenized")


def test_the_cap_is_configurable(tiny_model_dir, tmp_path):
    with running_service("preprocess", ["--model", str(tiny_model_dir), "--max-prompt-bytes", "10"], tmp_path) as svc:
        with grpc.insecure_channel(svc.address) as channel:
            stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
            assert stub.Preprocess(preprocess_pb2.PreprocessRequest(request_id="a", prompt="0123456789"), timeout=30)
            with pytest.raises(grpc.RpcError) as info:
                stub.Preprocess(preprocess_pb2.PreprocessRequest(request_id="b", prompt="0123456789!"), timeout=30)
        assert field_violation(info.value) == (
            "prompt", "11 bytes exceeds the limit of 10 bytes; not tokenized"
        )
    assert "max prompt 10 bytes" in (tmp_path / "preprocess.log").read_text()

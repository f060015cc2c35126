"""Oversized prompts are refused before tokenization (INVALID_ARGUMENT with the field and the
byte limit), at preprocess and through the gateway, and the services keep serving. Real servers
(torch backend) on the tiny model; the cap is derived from the context unless configured."""

from __future__ import annotations

import grpc
import pytest
from grpc_status import rpc_status

from llmserve.preprocess.validation import default_max_prompt_bytes
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, preprocess_pb2, preprocess_pb2_grpc
from tests.procs import running_service, running_stack

TEN_MB = 10 * 1024 * 1024


def field_violation(error: grpc.RpcError) -> tuple[str, str]:
    from google.rpc import error_details_pb2

    status = rpc_status.from_call(error)
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    violation = bad_request.field_violations[0]
    return violation.field, violation.description


def test_the_derived_cap_exceeds_what_the_context_can_hold():
    assert default_max_prompt_bytes(8192, 81) == 8192 * 81 * 2


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with running_stack(tiny_model_dir, tmp_path_factory.mktemp("prompt-bytes-logs")) as services:
        yield services


def test_a_10_mb_prompt_is_refused_untokenized_and_the_gateway_still_serves(stack):
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        huge = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="a " * (TEN_MB // 2)))
        with pytest.raises(grpc.RpcError) as info:
            gateway.Generate(huge, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        field, problem = field_violation(info.value)
        assert field == "prompt" and problem.startswith(f"{TEN_MB} bytes exceeds the limit of ")
        assert problem.endswith("not tokenized")
        sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        normal = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="hello", sampling=sampling))
        assert gateway.Generate(normal, timeout=60).result.usage.completion_tokens == 2


def test_chat_turns_count_together(stack):
    with grpc.insecure_channel(stack["preprocess"].address) as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        turns = [common_pb2.ChatMessage(role="user", content="b" * (TEN_MB // 4)) for _ in range(4)]
        request = preprocess_pb2.PreprocessRequest(request_id="r", chat=common_pb2.ChatInput(messages=turns))
        with pytest.raises(grpc.RpcError) as info:
            stub.Preprocess(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(info.value)[0] == "chat.messages"


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

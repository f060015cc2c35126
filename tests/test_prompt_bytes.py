"""Oversized prompts are refused before tokenization (INVALID_ARGUMENT with the field and the
byte limit), at preprocess and through the gateway, and the services keep serving. Real servers
(torch backend) on the tiny model; the cap is derived from the context unless configured."""

from __future__ import annotations

import grpc
import pytest

from llmserve.preprocess.tokenizer import ModelTokenizer
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, preprocess_pb2, preprocess_pb2_grpc
from tests.procs import running_service, running_stack
from tests.rich_status import field_violation

TEN_MB = 10 * 1024 * 1024


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


def test_the_derived_cap_never_refuses_a_prompt_of_context_many_longest_tokens(stack, tiny_model_dir):
    tokenizer = ModelTokenizer.load(tiny_model_dir)
    context = 256  # the tiny model's
    longest = max((tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)),
                  key=lambda text: len(text.encode("utf-8")))
    prompt = longest * (context - 1)
    assert len(prompt.encode("utf-8")) == (context - 1) * tokenizer.max_token_bytes
    with grpc.insecure_channel(stack["preprocess"].address) as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        request = preprocess_pb2.PreprocessRequest(request_id="long", prompt=prompt, max_tokens=1)
        try:
            stub.Preprocess(request, timeout=60)
        except grpc.RpcError as error:  # too many tokens is allowed here; too many bytes is not
            assert "bytes" not in field_violation(error)[1], error.details()


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

"""Bytes that do not parse as the RPC's message (invalid UTF-8 in a string field) get
INVALID_ARGUMENT naming the message, on every service, with one rate-limited log line and no
traceback; the server keeps serving. Real servers (torch backend) on the tiny model."""

from __future__ import annotations

import grpc
import pytest

from llmserve.v1 import common_pb2, gateway_pb2, inference_pb2, preprocess_pb2
from tests.procs import stack_fixture

MARK = "Xmark-utf8"
NUM_BAD_REQUESTS = 5


def invalid_utf8(message) -> bytes:
    """`message` serialized, with the first byte of the MARK string field made invalid UTF-8."""
    data = message.SerializeToString()
    assert data.count(MARK.encode()) == 1
    return data.replace(MARK.encode(), b"\xff" + MARK.encode()[1:])


stack = stack_fixture()


CASES = [
    ("gateway", "/llmserve.v1.GatewayService/GenerateStream", True,
     gateway_pb2.GenerateStreamRequest(params=gateway_pb2.GenerateParams(prompt=MARK)), "llmserve.v1.GenerateStreamRequest"),
    ("gateway", "/llmserve.v1.GatewayService/Generate", False,
     gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(
         chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content=MARK)]))),
     "llmserve.v1.GenerateRequest"),
    ("preprocess", "/llmserve.v1.PreprocessService/Preprocess", False,
     preprocess_pb2.PreprocessRequest(request_id="r1", prompt=MARK), "llmserve.v1.PreprocessRequest"),
    ("preprocess", "/llmserve.v1.PreprocessService/Tokenize", False,
     preprocess_pb2.TokenizeRequest(
         chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content=MARK)])),
     "llmserve.v1.TokenizeRequest"),
    ("inference", "/llmserve.v1.InferenceService/GenerateTokens", True,
     inference_pb2.GenerateTokensRequest(request_id=MARK, prompt_token_ids=[1, 2, 3]), "llmserve.v1.GenerateTokensRequest"),
]


@pytest.mark.parametrize(("service", "method", "is_stream", "message", "type_name"), CASES)
def test_invalid_utf8_is_invalid_argument_naming_the_message(stack, service, method, is_stream, message, type_name):
    with grpc.insecure_channel(stack[service].address) as channel:
        make_call = channel.unary_stream if is_stream else channel.unary_unary
        call = make_call(method, request_serializer=None, response_deserializer=None)
        for _ in range(NUM_BAD_REQUESTS):
            with pytest.raises(grpc.RpcError) as info:
                result = call(invalid_utf8(message), timeout=30)
                if is_stream:
                    list(result)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            details = info.value.details()
            assert details.startswith(f"request: not a valid protobuf message for {method}: ")
            assert type_name in details and "UTF-8" in details
    log_text = stack[service].log_path.read_text()
    lines = [line for line in log_text.splitlines() if f"rejected an undecodable request to {method}: " in line]
    assert len(lines) == 1  # rate-limited: one line stands for the burst
    assert "Traceback" not in log_text


def test_the_stack_still_serves_after_bad_bytes(stack):
    from llmserve.v1 import gateway_pb2_grpc

    with grpc.insecure_channel(stack["gateway"].address) as channel:
        sampling = common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        request = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="hello", sampling=sampling))
        response = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=60)
    assert response.result.usage.completion_tokens == 3


def test_truncated_token_ids_are_invalid_argument_too(stack):
    params = gateway_pb2.GenerateParams(prompt_token_ids=common_pb2.TokenIdsInput(token_ids=[300, 301, 302]))
    data = gateway_pb2.GenerateRequest(params=params).SerializeToString()
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        call = channel.unary_unary("/llmserve.v1.GatewayService/Generate", request_serializer=None,
                                   response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(data[:-1], timeout=30)  # the last id's varint cut in half
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert details.startswith("request: not a valid protobuf message for /llmserve.v1.GatewayService/Generate")

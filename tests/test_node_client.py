"""A Node.js client (tests/node: @grpc/grpc-js + @grpc/proto-loader on protos/) streams from
the gateway, in front of real preprocess and inference (torch backend) processes on the tiny
model, and gets what the Python client gets.

`make setup` installs tests/node's packages (`npm ci`); without Node the test is skipped.
"""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest

from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, preprocess_pb2, preprocess_pb2_grpc
from tests.node_env import NODE_DIR, node_with
from tests.procs import stack_fixture

NODE_TIMEOUT_S = 120
MAX_TOKENS = 12
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def node() -> str:
    return node_with("@grpc/grpc-js")


services = stack_fixture()


def node_stream(node: str, address: str, params: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [node, "generate_stream.js", address, json.dumps(params)],
        cwd=NODE_DIR, capture_output=True, text=True, timeout=NODE_TIMEOUT_S,
    )


def test_node_client_streams_what_the_python_client_gets(node, services):
    params = {"prompt": PROMPT, "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS}, "return_token_ids": True}
    result = node_stream(node, services["gateway"].address, params)
    assert result.returncode == 0, result.stderr
    streamed = json.loads(result.stdout)
    messages = streamed["messages"]

    with grpc.insecure_channel(services["gateway"].address) as channel:
        expected = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            gateway_pb2.GenerateRequest(
                params=gateway_pb2.GenerateParams(
                    prompt=PROMPT,
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                    return_token_ids=True,
                )
            )
        )
    with grpc.insecure_channel(services["preprocess"].address) as channel:
        prompt = preprocess_pb2_grpc.PreprocessServiceStub(channel).Tokenize(preprocess_pb2.TokenizeRequest(text=PROMPT))

    assert len(messages) > 1
    assert "".join(m.get("text", "") for m in messages) == expected.text != ""  # proto3: "" is absent
    assert [t for m in messages for t in m.get("token_ids", [])] == list(expected.token_ids)
    assert all("result" not in m for m in messages[:-1])
    final = messages[-1]["result"]
    assert final["finish_reason"] == "FINISH_REASON_LENGTH"
    assert final["usage"]["completion_tokens"] == MAX_TOKENS
    assert final["usage"]["prompt_tokens"] == len(prompt.token_ids)
    assert 0 < final["timings"]["time_to_first_token_ns"] <= final["timings"]["total_time_ns"]
    assert {m["request_id"] for m in messages} == {streamed["request_id_metadata"]}


def test_node_client_gets_invalid_argument_with_the_field(node, services):
    result = node_stream(node, services["gateway"].address, {"prompt": ""})
    assert result.returncode == 1
    assert result.stderr.startswith("INVALID_ARGUMENT: prompt: must not be empty"), result.stderr

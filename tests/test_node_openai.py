"""The official `openai` npm package (tests/node/chat_stream.js) streams a chat completion from
the gateway's OpenAI HTTP API, in front of real preprocess and inference (torch backend)
processes on the default model, and gets what a non-streamed call gets: greedy, the same text,
finish reason and token counts.

`make setup` installs tests/node's packages (`npm ci`); without Node or npm the test is skipped.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from tests.node_env import NODE_DIR, node_with
from tests.procs import free_port, stack_fixture

pytestmark = pytest.mark.slow

NODE_TIMEOUT_S = 120
HTTP_PORT = free_port()
stack = stack_fixture(model="default_model_dir", gateway_args=["--http-port", str(HTTP_PORT)])
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}/v1"
CHAT = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Name three colors of the rainbow."}],
        "temperature": 0, "max_tokens": 24}  # fmt: skip


@pytest.fixture(scope="module")
def node() -> str:
    return node_with("openai")


def node_chat_stream(node: str, request: dict) -> subprocess.CompletedProcess:
    return subprocess.run([node, "chat_stream.js", BASE_URL, json.dumps(request)], cwd=NODE_DIR,
                          capture_output=True, text=True, timeout=NODE_TIMEOUT_S)


def whole_chat_completion(request: dict) -> dict:
    """The same request, not streamed, from Python's standard library: no client shared with Node."""
    post = urllib.request.Request(f"{BASE_URL}/chat/completions", data=json.dumps(request).encode(),
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=NODE_TIMEOUT_S) as response:
        return json.load(response)


def test_the_node_openai_package_streams_what_a_whole_call_answers(node, stack):
    result = node_chat_stream(node, CHAT)
    assert result.returncode == 0, result.stderr
    streamed = json.loads(result.stdout)
    whole = whole_chat_completion({**CHAT, "model": streamed["model"]})
    [choice] = whole["choices"]

    assert streamed["model"] == "smollm2-135m-instruct"
    assert streamed["text"] == choice["message"]["content"] != ""
    assert streamed["finish_reason"] == choice["finish_reason"]
    assert streamed["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert streamed["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert 1 < streamed["content_chunks"] <= streamed["usage"]["completion_tokens"]
    assert len(streamed["request_id"]) == 32  # the gateway's x-request-id header, read by the client


def test_the_node_openai_package_raises_the_gateways_400(node, stack):
    result = node_chat_stream(node, {**CHAT, "messages": []})
    assert result.returncode == 1
    assert result.stderr.startswith("BadRequestError: 400 messages: must hold at least one message"), result.stderr

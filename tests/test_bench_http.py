"""`llmserve bench --http`: the load generator against the gateway's OpenAI HTTP API, on a real
stack (preprocess, inference on the torch backend, a gateway with --http-port) on the default
model, over loopback. Its numbers must agree with themselves and with the gRPC mode's on the same
planned requests: every completion token the usage chunks count is one asked for (greedy,
ignore_eos), each face's server counts the same prompt tokens, and ITL has one sample per content
chunk after the first.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.procs import free_port, stack_fixture

pytestmark = pytest.mark.slow

HTTP_PORT = free_port()
stack = stack_fixture(model="default_model_dir", gateway_args=["--http-port", str(HTTP_PORT)])
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}/v1"
NUM_REQUESTS, OUTPUT_TOKENS = 6, 8
WORKLOAD = ["--num-requests", str(NUM_REQUESTS), "--concurrency", "3", "--prompt-tokens", "uniform:24:40",
            "--output-tokens", str(OUTPUT_TOKENS), "--seed", "7", "--no-progress"]


def _bench(stack, default_model_dir, out_dir, name: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmserve.tools.cli", "bench", "--address", stack["gateway"].address,
               "--tokenizer", str(default_model_dir), "--out-dir", str(out_dir), "--name", name, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _report(stack, default_model_dir, out_dir, name: str, *args: str) -> dict:
    completed = _bench(stack, default_model_dir, out_dir, name, *args)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((out_dir / f"{name}.json").read_text())


@pytest.mark.parametrize("form_args", [[], ["--chat"], ["--token-ids"]], ids=["text", "chat", "token-ids"])
def test_http_bench_counts_what_was_asked_and_agrees_with_grpc(stack, default_model_dir, tmp_path, form_args):
    http = _report(stack, default_model_dir, tmp_path, "http", "--http", BASE_URL, *WORKLOAD, *form_args)
    grpc = _report(stack, default_model_dir, tmp_path, "grpc", *WORKLOAD, *form_args, "--no-plots")
    assert http["config"]["api"] == "openai-http" and http["config"]["model"] == "smollm2-135m-instruct"
    summary = http["summary"]
    assert summary["num_succeeded"] == NUM_REQUESTS and summary["errors_by_status"] == {}
    assert summary["num_completion_tokens"] == NUM_REQUESTS * OUTPUT_TOKENS  # from the usage chunks
    assert summary["num_prompt_tokens"] == grpc["summary"]["num_prompt_tokens"]  # the same prompts, either face
    # One message per content chunk: at most one per token (the gateway may coalesce or hold
    # text back, never split a token), and one ITL sample per chunk after each request's first.
    assert NUM_REQUESTS <= summary["num_messages"] <= summary["num_completion_tokens"]
    assert summary["itl_ms"]["count"] == summary["num_messages"] - NUM_REQUESTS
    assert summary["ttft_ms"]["count"] == NUM_REQUESTS
    assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert summary["output_tokens_per_s"] > 0
    assert http["client"]["cpu_s"] > 0 and http["client"]["cpu_us_per_output_token"] > 0
    assert (tmp_path / "http-latency.png").is_file() and (tmp_path / "http-throughput.png").is_file()


def test_http_bench_replays_chat_conversations(stack, default_model_dir, tmp_path):
    report = _report(stack, default_model_dir, tmp_path, "turns", "--http", BASE_URL, "--chat", "--turns", "2",
                     "--num-requests", "4", "--concurrency", "2", "--prompt-tokens", "20", "--output-tokens", "6",
                     "--no-plots", "--no-progress")
    summary = report["summary"]
    assert summary["num_succeeded"] == 4 and summary["num_completion_tokens"] == 4 * 6
    assert summary["num_cached_tokens"] > 0  # each second turn starts with its first turn's KV


def test_http_bench_counts_refusals_by_http_status(stack, default_model_dir, tmp_path):
    completed = _bench(stack, default_model_dir, tmp_path, "refused", "--http", BASE_URL, "--num-requests", "2",
                       "--output-tokens", "100000", "--no-plots", "--no-progress")
    assert completed.returncode == 1
    summary = json.loads((tmp_path / "refused.json").read_text())["summary"]
    assert summary["errors_by_status"] == {"HTTP_400": 2}
    assert "max_tokens" in summary["first_errors"][0]


def test_http_bench_refuses_token_id_conversations(stack, default_model_dir, tmp_path):
    completed = _bench(stack, default_model_dir, tmp_path, "x", "--http", BASE_URL, "--token-ids", "--turns", "2")
    assert completed.returncode != 0 and "--http --turns" in completed.stderr

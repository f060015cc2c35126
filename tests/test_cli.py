"""The `llmserve` command: serve a tiny model, talk to it as a user would, stop it cleanly."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from llmserve.tools.cli import main
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.procs import free_port

SERVE_START_TIMEOUT_S = 180.0
SERVE_STOP_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 60.0
LISTENING_PREFIX = "gateway listening on "


def llmserve_command() -> list[str]:
    """The installed console script if there is one, else the module."""
    script = Path(sys.executable).parent / "llmserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "llmserve.tools.cli"]


def pids_with_argument(argument: str) -> set[int]:
    """Live processes whose command line contains `argument` (a unique temp path)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if "State:\tZ" in status:  # a zombie has exited already
            continue
        if any(argument.encode() in part for part in cmdline):
            pids.add(int(entry.name))
    return pids


class ServeProcess:
    """`llmserve serve` as a subprocess: stdout lines in a queue, stderr in a file."""

    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [*llmserve_command(), "serve", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_address(self) -> str:
        """The address from the 'gateway listening on HOST:PORT' line."""
        while True:
            try:
                line = self.lines.get(timeout=SERVE_START_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"serve printed no address in {SERVE_START_TIMEOUT_S}s; log:\n{self.log()}")
            if line is None:
                pytest.fail(f"serve exited with {self.process.wait()} before listening; log:\n{self.log()}")
            if line.startswith(LISTENING_PREFIX):
                return line.removeprefix(LISTENING_PREFIX).strip()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=SERVE_STOP_TIMEOUT_S)
        finally:
            self.process.kill()
            self.process.wait()
            self._log.close()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()


def run_client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*llmserve_command(), *args], capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
    )


@pytest.fixture
def private_model_dir(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny model at a unique path, so the test can find its own processes."""
    model_dir = tmp_path / "model-under-test"
    shutil.copytree(tiny_model_dir, model_dir)
    return model_dir


def test_serve_generate_chat_models_then_sigterm_stops_everything(private_model_dir, tmp_path):
    http_port = free_port()  # serve's HTTP API is on by default (8000): here on a port of the test's
    serve = ServeProcess(
        ["--model", str(private_model_dir), "--backend", "hf", "--port", "0", "--http-port", str(http_port)],
        tmp_path / "serve.log",
    )  # fmt: skip
    try:
        address = serve.wait_for_address()
        child_pids = pids_with_argument(str(private_model_dir)) - {serve.process.pid}
        assert len(child_pids) == 3, serve.log()  # preprocess, inference, gateway
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(address))
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=16)

        prompt = gateway_pb2.GenerateParams(prompt="The capital of France is", sampling=sampling)
        expected = stub.Generate(gateway_pb2.GenerateRequest(params=prompt))
        result = run_client(
            "generate", "The capital of France is", "--address", address, "--temperature", "0", "--max-tokens", "16"
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout == expected.text + "\n"
        assert "finish: length | tokens: prompt " in result.stderr
        assert f"completion {expected.result.usage.completion_tokens}," in result.stderr
        body = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 16}
        http_request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(http_request, timeout=CLIENT_TIMEOUT_S) as http_response:
            assert json.loads(http_response.read())["choices"][0]["text"] == expected.text

        chat = common_pb2.ChatInput(
            messages=[
                common_pb2.ChatMessage(role="system", content="Be brief."),
                common_pb2.ChatMessage(role="user", content="Hi there"),
            ]
        )
        chat_params = gateway_pb2.GenerateParams(chat=chat, sampling=sampling)
        expected_chat = stub.Generate(gateway_pb2.GenerateRequest(params=chat_params))
        result = run_client(
            "chat", "Hi there", "--system", "Be brief.",
            "--address", address, "--temperature", "0", "--max-tokens", "16",
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout == expected_chat.text + "\n"

        result = run_client("models", "--address", address)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split("\t")[:2] == ["model-under-test", "LlamaForCausalLM"]

        result = run_client("generate", "", "--address", address)
        assert result.returncode == 1
        assert result.stdout == ""
        assert "error: INVALID_ARGUMENT: prompt: must not be empty" in result.stderr
    finally:
        exit_code = serve.stop()
    assert exit_code == 0, serve.log()
    assert pids_with_argument(str(private_model_dir)) == set()
    log = serve.log()
    gateway_stop = re.search(r"gateway(/\d+)? llmserve.server: signal received", log).start()  # any worker
    assert gateway_stop < log.index("inference llmserve.server: signal received")
    assert gateway_stop < log.index("preprocess llmserve.server: signal received")


def test_serve_replicas_are_routed_by_their_kv_cache(private_model_dir, tmp_path):
    serve = ServeProcess(
        ["--model", str(private_model_dir), "--replicas", "2", "--port", "0", "--gateway-workers", "1",
         "--gateway-worker-ports", "0"],
        tmp_path / "serve.log",
    )
    try:
        address = serve.wait_for_address()
        assert len(pids_with_argument(str(private_model_dir)) - {serve.process.pid}) == 4, serve.log()
        # --gateway-worker-ports: the banner gives the target of every worker's own port (one here)
        banner = [serve.lines.get(timeout=5)]
        while "Ctrl-C stops all services" not in banner[-1]:
            banner.append(serve.lines.get(timeout=5))
        by_call = next(line for line in banner if line.startswith("  by call: llmserve bench --address "))
        target = by_call.split("--address ")[1].split()[0]
        assert re.fullmatch(r"ipv4:127\.0\.0\.1:\d+", target) and target.rsplit(":", 1)[1] != address.rsplit(":", 1)[1]
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(target))
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=4)

        def send(prompt):
            params = gateway_pb2.GenerateParams(prompt=prompt, sampling=sampling)
            return stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=60).result

        # Distinct prompts on an idle fleet are taken in turn; a prompt sent again goes back to
        # the replica that cached it, and reuses its blocks there.
        prompts = [f"Tell me about topic {i}. " * 8 for i in range(4)]
        first = [send(prompt) for prompt in prompts]
        assert {result.routing.replica_id for result in first} == {"replica-0", "replica-1"}, serve.log()
        for prompt, before in zip(prompts, first):
            again = send(prompt)
            assert again.routing.replica_id == before.routing.replica_id
            assert again.usage.cached_tokens > 0
            assert again.routing.predicted_cached_tokens == again.usage.cached_tokens
    finally:
        exit_code = serve.stop()
    assert exit_code == 0, serve.log()
    assert pids_with_argument(str(private_model_dir)) == set()


def test_serve_fails_fast_with_the_log_of_a_child_that_dies(private_model_dir, tmp_path):
    # Weights that cannot be read: preprocess starts, inference exits during start-up.
    (private_model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    serve = ServeProcess(["--model", str(private_model_dir), "--backend", "hf", "--port", "0"], tmp_path / "serve.log")
    exit_code = serve.process.wait(timeout=SERVE_START_TIMEOUT_S)
    serve.stop()
    log = serve.log()
    assert exit_code == 1, log
    assert "inference exited with code 1 during start-up; last log lines:" in log
    assert serve.lines.get(timeout=5) is None  # it never printed an address
    assert pids_with_argument(str(private_model_dir)) == set()


def test_children_exit_when_serve_is_killed(private_model_dir, tmp_path):
    """SIGKILL leaves the launcher no chance to stop its children: they get SIGTERM from the
    kernel (PR_SET_PDEATHSIG) and drain and exit on their own."""
    serve = ServeProcess(["--model", str(private_model_dir), "--backend", "hf", "--port", "0"], tmp_path / "serve.log")
    try:
        serve.wait_for_address()
        assert len(pids_with_argument(str(private_model_dir)) - {serve.process.pid}) == 3
    finally:
        serve.process.send_signal(signal.SIGKILL)
        serve.stop()
    deadline = time.monotonic() + SERVE_STOP_TIMEOUT_S
    while pids_with_argument(str(private_model_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_with_argument(str(private_model_dir)) == set(), serve.log()


def test_fetch_model_resolves_a_local_checkpoint(tiny_model_dir, capsys):
    assert main(["fetch-model", "--model", str(tiny_model_dir)]) == 0
    assert capsys.readouterr().out == f"{tiny_model_dir.resolve()}\n"


def test_fetch_model_reports_an_unknown_model(tmp_path, capsys):
    assert main(["fetch-model", "--model", str(tmp_path / "missing")]) == 2
    assert "is neither a local path nor a known model name" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["serve"], ["chat"], ["generate"], ["models"], ["fetch-model"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: llmserve" in capsys.readouterr().out


def test_unreachable_gateway_is_an_error_with_a_hint():
    result = run_client("generate", "hello", "--address", "127.0.0.1:1", "--timeout-s", "10")
    assert result.returncode == 1
    assert "error: UNAVAILABLE: " in result.stderr
    assert "hint: is `llmserve serve` running" in result.stderr


def test_the_services_import_without_redis_py():
    """Serving on the embedded defaults needs no Redis: redis-py is imported only with --redis-url."""
    code = ("import sys; sys.modules['redis'] = None\n"  # any `import redis...` now raises ImportError
            "import llmserve.preprocess.__main__, llmserve.inference.__main__, llmserve.gateway.__main__, llmserve.tools.launcher")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]

"""A gateway in front of several preprocess servers (issue 10, preprocess at scale), with real
processes on the tiny model: requests spread over the replicas, a replica SIGKILLed mid-run costs
no request (a call it was serving is retried on the other), a restarted one takes calls again, a
dns:/// target works, and a replica whose model info differs from the first one's is refused.

Which replica served a request is read from its own log (preprocess logs each request at DEBUG)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.discovery import Target
from llmserve.gateway.preprocess_servers import PreprocessServers
from llmserve.tools.service_process import ServiceProcess, start_service, stop_service
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

NUM_CLIENTS = 4
SERVED_LINE = " prompt_tokens="  # preprocess's DEBUG line for each request it answered


def start_preprocess(model_dir: Path, log_dir: Path, name: str, *flags: str) -> ServiceProcess:
    return start_service(name, ["--model", str(model_dir), "--log-level", "DEBUG", *flags], log_dir,
                         module="llmserve.preprocess")


def num_served(log_path: Path) -> int:
    return log_path.read_text().count(SERVED_LINE) if log_path.exists() else 0


def generate(stub, i: int) -> gateway_pb2.GenerateResponse:
    params = gateway_pb2.GenerateParams(prompt=f"Request {i} says hello to", sampling=common_pb2.SamplingParams(
        max_tokens=2, temperature=0.0))
    return stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=60)


class Load:
    """NUM_CLIENTS threads sending requests one after another until stopped; every outcome kept."""

    def __init__(self, address: str):
        self._channel = grpc.insecure_channel(address)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self._stop = threading.Event()
        self.num_sent = 0
        self._pool = ThreadPoolExecutor(NUM_CLIENTS)
        self._clients = [self._pool.submit(self._client, c) for c in range(NUM_CLIENTS)]

    def _client(self, client: int) -> list[str]:
        errors = []
        while not self._stop.is_set():
            self.num_sent += 1
            try:
                generate(self._stub, client * 100_000 + self.num_sent)
            except grpc.RpcError as error:
                errors.append(f"{error.code().name}: {error.details()}")
        return errors

    def stop(self) -> list[str]:
        """The errors every client met."""
        self._stop.set()
        errors = [error for client in self._clients for error in client.result()]
        self._pool.shutdown()
        self._channel.close()
        return errors


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def inference(tiny_model_dir, tmp_path_factory):
    with_logs = tmp_path_factory.mktemp("inference")
    service = start_service("inference", ["--model", str(tiny_model_dir), "--backend", "torch"], with_logs)
    yield service
    stop_service(service)


def start_gateway(model_dir: Path, log_dir: Path, inference: ServiceProcess, *preprocess: str) -> ServiceProcess:
    targets = [arg for target in preprocess for arg in ("--preprocess", target)]
    # Every prompt to the pool: these small prompts would otherwise be preprocessed in the gateway.
    return start_service("gateway", ["--model", str(model_dir), *targets, "--inference", inference.address,
                                     "--local-preprocess-max-bytes", "0"], log_dir, module="llmserve.gateway")


def test_requests_spread_and_survive_a_killed_preprocess_replica_that_then_comes_back(
    tiny_model_dir, inference, tmp_path
):
    a, b = (start_preprocess(tiny_model_dir, tmp_path / name, "preprocess") for name in ("a", "b"))
    a_log, b_log = tmp_path / "a/preprocess.log", tmp_path / "b/preprocess.log"
    restarted = None
    gateway = start_gateway(tiny_model_dir, tmp_path, inference, a.address, b.address)
    try:
        load = Load(gateway.address)
        wait_for(lambda: num_served(a_log) >= 10 and num_served(b_log) >= 10)
        a.kill()  # SIGKILL, with requests in flight on it
        served_by_b = num_served(b_log)
        wait_for(lambda: num_served(b_log) >= served_by_b + 40)  # the load goes on, on b alone

        restarted = start_preprocess(tiny_model_dir, tmp_path / "a-again", "preprocess", "--port", str(a.port))
        wait_for(lambda: num_served(tmp_path / "a-again/preprocess.log") >= 10)
        served_by_b = num_served(b_log)
        wait_for(lambda: num_served(b_log) >= served_by_b + 10)  # and both take calls again
        assert load.stop() == []
        assert load.num_sent > 100
    finally:
        for service in (gateway, restarted, b):
            if service is not None:
                stop_service(service)


def test_a_dns_target_that_resolves_to_loopback(tiny_model_dir, inference, tmp_path):
    replicas = [start_preprocess(tiny_model_dir, tmp_path / name, "preprocess") for name in ("a", "b")]
    gateway = start_gateway(tiny_model_dir, tmp_path, inference, *(f"dns:///localhost:{r.port}" for r in replicas))
    try:
        with grpc.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            assert all(generate(stub, i).result.usage.completion_tokens == 2 for i in range(20))
        assert all(num_served(tmp_path / name / "preprocess.log") >= 5 for name in ("a", "b"))
    finally:
        for service in (gateway, *replicas):
            stop_service(service)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_replica_whose_model_info_differs_is_refused_and_never_called(tiny_model_dir, tmp_path, caplog):
    same = start_preprocess(tiny_model_dir, tmp_path / "same", "preprocess")
    other = start_preprocess(tiny_model_dir, tmp_path / "other", "preprocess", "--block-size", "32")
    other.send_signal(signal.SIGSTOP)  # not answering yet: the reference is `same`, deterministically
    config = GatewayConfig(
        preprocess_targets=(Target.parse(same.address), Target.parse(other.address)),
        inference_targets=(Target.parse("127.0.0.1:1"),), model_path=tiny_model_dir,
    )
    replicas = PreprocessServers(config)
    try:
        with caplog.at_level(logging.INFO, logger="llmserve.gateway.preprocess_servers"):
            info = await replicas.start()
            assert info.block_layout.block_size_tokens == 16
            other.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 30
            while "refused" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                await asyncio.sleep(0.1)
        assert (
            f"preprocess at {other.address} refused: its model info differs from preprocess at {same.address}'s "
            "(block_size_tokens 32 vs 16); start every preprocess server with the same --model and engine flags"
        ) in caplog.text
        prompt = "The capital of France is"
        for i in range(6):
            await replicas.pool.preprocess(f"r{i}", prompt, max_tokens=2, cache_salt="", timeout_s=20)
        assert {status.address: status.num_calls for status in replicas.pool.status()} == {same.address: 6}
        assert num_served(tmp_path / "other/preprocess.log") == 0
    finally:
        await replicas.close()
        other.send_signal(signal.SIGCONT)
        for service in (same, other):
            stop_service(service)

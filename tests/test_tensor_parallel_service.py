"""`python -m llmserve.inference --tensor-parallel-size 2` over real gRPC, on CPU (gloo): the same
greedy tokens as the engine on one process, and a rank that dies ends every request in flight
with FINISH_REASON_ERROR naming the rank, health turns NOT_SERVING, new requests are refused
with UNAVAILABLE, no rank process is left behind, and SIGTERM still exits cleanly."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import signal
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_process import EngineProcess
from llmserve.inference.engine.rank_worker import check_gpus_for_ranks
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.servicer import SERVICE_NAME
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.engine_objects import make_request
from tests.engine_streams import collect, wait_until
from tests.test_inference_service import HANG_GUARD_S, _wait_for_port_file, read_all
from tests.test_torch_engine import drain, greedy, make_prompt, request

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = [make_prompt(n, seed=500 + n) for n in (9, 23, 40)]
NUM_TOKENS = 24
EXIT_WAIT_S = 120


def one_process_tokens(model_dir) -> list[list[int]]:
    engine = TorchEngineCore(EngineConfig(model_path=model_dir, model_name="tiny"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(request(f"p{i}", prompt, greedy(NUM_TOKENS)))
    results = drain(engine)
    return [results[f"p{i}"].token_ids[0] for i in range(len(PROMPTS))]


async def generate(stub, request_id: str, prompt: list[int], **sampling) -> list[inference_pb2.GenerateTokensResponse]:
    call = stub.GenerateTokens(
        inference_pb2.GenerateTokensRequest(
            request_id=request_id, prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, **sampling),
        )  # fmt: skip
    )
    return await read_all(call)


def logged_pid(log_text: str, pattern: str) -> int:
    return int(re.search(pattern, log_text).group(1))


def is_running(pid: int) -> bool:
    """The process exists and has not ended (a zombie not yet reaped has ended)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def health_status(channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    return response.status


async def test_two_ranks_serve_the_one_process_tokens_and_a_dead_rank_fails_the_replica(tiny_model_dir, tmp_path):
    port_file, log_path = tmp_path / "port", tmp_path / "server.log"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "llmserve.inference", "--model", str(tiny_model_dir), "--model-name", "tiny",
            "--tensor-parallel-size", "2", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
            "--log-level", "INFO",
        ],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        port = await _wait_for_port_file(process, port_file)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
            served = await asyncio.gather(
                *(generate(stub, f"p{i}", prompt, max_tokens=NUM_TOKENS) for i, prompt in enumerate(PROMPTS))
            )
            expected = await asyncio.to_thread(one_process_tokens, tiny_model_dir)
            assert [[t for r in responses for t in r.token_ids] for responses in served] == expected

            log_text = log_path.read_text()
            rank_1 = logged_pid(log_text, r"tensor-parallel rank 1 runs in process (\d+)")
            core = logged_pid(log_text, r"engine core runs in process (\d+)")
            call = stub.GenerateTokens(
                inference_pb2.GenerateTokensRequest(
                    request_id="orphan", prompt_token_ids=PROMPTS[0],
                    sampling=common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, n=2),
                )  # fmt: skip
            )
            first = await asyncio.wait_for(call.read(), HANG_GUARD_S)
            os.kill(rank_1, signal.SIGKILL)
            responses = [first, *await read_all(call)]
            finals = [r for r in responses if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
            assert [r.finish_reason for r in finals] == [common_pb2.FINISH_REASON_ERROR] * 2
            assert all(f"tensor-parallel rank 1 (process {rank_1}) exited with code -9" in r.error_message
                       for r in finals)  # fmt: skip
            await wait_until(lambda: not is_running(core))  # ended with the rank: it could not go on
            assert await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(stub, "after", PROMPTS[0], max_tokens=4)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        os.kill(process.pid, signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, EXIT_WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "health NOT_SERVING" in log_path.read_text()


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--tensor-parallel-size", "3"], "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
        (["--tensor-parallel-size", "2", "--backend", "hf"], "tensor_parallel_size 2 needs the torch backend"),
        (["--tensor-parallel-size", "2", "--kv-pull"], "tensor_parallel_size 2 cannot be used with --kv-pull"),
        pytest.param(
            ["--tensor-parallel-size", "2", "--device", "cuda:0"], "tensor_parallel_size 2 on cuda:0 needs GPUs 0..1, and",
            marks=pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has the GPUs"),
        ),
    ],
)
async def test_a_split_the_engine_cannot_run_exits_with_the_reason(tiny_model_dir, tmp_path, flags, reason):
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "llmserve.inference", "--model", str(tiny_model_dir), "--port", "0", *flags],
        capture_output=True, text=True, timeout=EXIT_WAIT_S,
    )  # fmt: skip
    assert result.returncode == 1
    assert reason in result.stderr + result.stdout


async def test_ranks_need_their_gpus_visible():
    check_gpus_for_ranks("cuda:2", 2, num_gpus=4)  # GPUs 2 and 3
    check_gpus_for_ranks("cpu", 8, num_gpus=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 on cuda:3 needs GPUs 3..4, and 4 are visible here"):
        check_gpus_for_ranks("cuda:3", 2, num_gpus=4)


async def test_a_split_engine_stops_cleanly_every_rank_exiting_by_itself(tiny_model_dir):
    """AsyncEngine over EngineProcess (what the service runs): serve, shut down, and every rank's
    process (the engine core's too) has left with code 0 — none killed, none left behind."""
    children_before = set(multiprocessing.active_children())
    config = EngineConfig(model_path=tiny_model_dir, model_name="tiny", tensor_parallel_size=2)
    engine = AsyncEngine(EngineProcess(config))
    processes = set(multiprocessing.active_children()) - children_before
    assert len(processes) == 2  # the engine core (rank 0) and rank 1
    await engine.start()
    outputs = await collect(engine, make_request("r", PROMPTS[1], max_tokens=NUM_TOKENS, temperature=0.0,
                                                 ignore_eos=True))
    assert [t for o in outputs for t in o.new_token_ids] == (await asyncio.to_thread(one_process_tokens, tiny_model_dir))[1]
    await engine.shutdown(drain_timeout_s=5.0)
    assert sorted(p.exitcode for p in processes) == [0, 0]

"""A deadline that passes in the engine ends the request with the DEADLINE_EXCEEDED status on
both generating RPCs (a typed status, never a finish reason with words to compare), and frees
its KV blocks. Each RPC on a fresh replica: with nothing measured yet, admission cannot predict
the miss, so the request is admitted and the engine loop aborts it at a step boundary."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.rpc import status_pb2

from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.procs import running_service

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [5, 17, 42, 99, 100, 7, 250, 31]
HANG_GUARD_S = 60.0
# 240 tokens in 50 ms would be 0.2 ms a step: far faster than any CPU runs the engine loop.
MAX_TOKENS = 240
TIMEOUT_MS = 50
ENGINE_WORDS = "aborted the request at an engine step boundary"


@pytest.fixture
def fresh_replica(tiny_model_dir, tmp_path):
    with running_service("inference", ["--model", str(tiny_model_dir), "--num-kv-blocks", "64"], tmp_path) as service:
        yield service.address


def late_request(request_id: str) -> inference_pb2.GenerateTokensRequest:
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return inference_pb2.GenerateTokensRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling, timeout_ms=TIMEOUT_MS
    )


async def wait_until_idle(stub) -> inference_pb2.GetLoadResponse:
    deadline = time.monotonic() + HANG_GUARD_S
    while (load := await stub.GetLoad(inference_pb2.GetLoadRequest())).kv_blocks_used or load.num_running:
        assert time.monotonic() < deadline, "the request was never freed"
        await asyncio.sleep(0.02)
    return load


async def test_generate_tokens_ends_with_deadline_exceeded(fresh_replica):
    async with grpc.aio.insecure_channel(fresh_replica) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        call = stub.GenerateTokens(late_request("late"))  # no call deadline: timeout_ms alone
        num_tokens = 0
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for response in call:
                assert not response.finish_reason, "a deadline is a status, not a finish reason"
                num_tokens += len(response.token_ids)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert ENGINE_WORDS in error.value.details()
        assert num_tokens < MAX_TOKENS
        load = await wait_until_idle(stub)
        assert load.num_aborted_total == 1


async def test_multiplex_ends_the_request_with_a_deadline_exceeded_status(fresh_replica):
    async with grpc.aio.insecure_channel(fresh_replica) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        call = stub.Multiplex()
        await call.write(inference_pb2.MultiplexRequest(generate=late_request("late")))
        outputs: list[inference_pb2.RequestOutput] = []
        while not (outputs and outputs[-1].error_status):
            response = await asyncio.wait_for(call.read(), HANG_GUARD_S)
            assert response is not grpc.aio.EOF
            outputs += response.outputs
        assert all(not output.output.finish_reason for output in outputs)
        status = status_pb2.Status.FromString(outputs[-1].error_status)
        assert status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert ENGINE_WORDS in status.message
        assert sum(len(output.output.token_ids) for output in outputs) < MAX_TOKENS
        load = await wait_until_idle(stub)
        assert load.num_aborted_total == 1
        call.cancel()

"""Overload through the full stack on the default model (issue 9's CPU target): 500 concurrent
streams with 30 s deadlines, each a client that retries after the RESOURCE_EXHAUSTED hint while
its deadline leaves time, end with success or a typed refusal (DEADLINE_EXCEEDED as a refusal
at admission: the admitted meet their deadline, all but at most MAX_RUN_OUT_FRACTION of them),
and the KV pool is whole afterwards.

Why a bound, not none: admission's finish estimate (with its step-in-progress and 10% slack,
docs/reliability.md) is learnt from this replica's steps, but on a 2-core machine the 500
clients, the gateway and preprocess share the cores with the engine, and in full-suite runs a
few admitted streams still ran out (CI before the slack: 300 of 500).

Needs the inference servicer to pass the gRPC deadline on as EngineRequest.deadline_ns: without
it the replica cannot refuse what it cannot finish in time.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

import grpc
import pytest

from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.procs import running_stack
from tests.rich_status import is_refused_at_admission, retry_delay_ms

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

NUM_STREAMS = 500
DEADLINE_S = 30.0
MAX_TOKENS = 8  # bounds the test's time: the load is the number of streams, not their length
POOL_FREE_WITHIN_S = 30.0
MAX_RUN_OUT_FRACTION = 0.05  # of the streams: admitted, then ended at their deadline


@dataclass(frozen=True, slots=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    retry_after_ms: int | None = None


def _params(index: int) -> gateway_pb2.GenerateParams:
    return gateway_pb2.GenerateParams(
        prompt=f"Request {index}: write one sentence about the number {index * 7919 % 1000}.",
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )


async def _attempt(stub: gateway_pb2_grpc.GatewayServiceStub, index: int, timeout_s: float) -> Outcome:
    call = stub.GenerateStream(gateway_pb2.GenerateStreamRequest(params=_params(index)), timeout=timeout_s)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as error:
        retry_after_ms = retry_delay_ms(error) if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED else None
        return Outcome(error.code(), error.details() or "", retry_after_ms)
    return Outcome(grpc.StatusCode.OK, "")


async def _stream(stub: gateway_pb2_grpc.GatewayServiceStub, index: int) -> tuple[Outcome, int]:
    """As a well-behaved client: on RESOURCE_EXHAUSTED, retry after the hint while the deadline
    (DEADLINE_S from the first attempt) leaves time. The last outcome and the number of tries."""
    deadline = time.monotonic() + DEADLINE_S
    num_tries = 0
    while True:
        num_tries += 1
        outcome = await _attempt(stub, index, deadline - time.monotonic())
        retry_at = time.monotonic() + (outcome.retry_after_ms or 0) / 1000
        if outcome.code is not grpc.StatusCode.RESOURCE_EXHAUSTED or retry_at >= deadline:
            return outcome, num_tries
        await asyncio.sleep(retry_at - time.monotonic())


async def _wait_for_free_pool(address: str) -> inference_pb2.GetLoadResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        deadline = time.monotonic() + POOL_FREE_WITHIN_S
        while True:
            load = await stub.GetLoad(inference_pb2.GetLoadRequest())
            if load.kv_blocks_used == 0 or time.monotonic() > deadline:
                return load
            await asyncio.sleep(0.2)


async def test_500_streams_with_deadlines_end_in_success_or_a_typed_refusal(default_model_dir, tmp_path):
    with running_stack(default_model_dir, tmp_path) as stack:
        async with grpc.aio.insecure_channel(stack["gateway"].address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            started = time.monotonic()
            results = await asyncio.gather(*(_stream(stub, i) for i in range(NUM_STREAMS)))
            wall_s = time.monotonic() - started
        load = await _wait_for_free_pool(stack["inference"].address)
    outcomes = [outcome for outcome, _ in results]
    counts = collections.Counter(outcome.code.name for outcome in outcomes)
    num_tries = sum(tries for _, tries in results)
    print(f"\n{NUM_STREAMS} streams ({num_tries} tries) in {wall_s:.1f} s: {dict(counts)}")
    assert set(counts) <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, outcomes
    assert counts["OK"] > 0
    run_out = [o for o in outcomes if o.code is grpc.StatusCode.DEADLINE_EXCEEDED and not is_refused_at_admission(o.details)]
    print(f"admitted, then past their deadline: {len(run_out)}")
    for outcome in outcomes:
        if outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert outcome.retry_after_ms and outcome.retry_after_ms > 0, outcome
    assert len(run_out) <= MAX_RUN_OUT_FRACTION * NUM_STREAMS, run_out[:3]
    assert load.kv_blocks_used == 0 and load.num_running == 0 and load.num_waiting == 0

"""Preprocess under floods of oversized and of long prompts: refusals are precise statuses, a
normal request beside them succeeds, and what waits for the tokenizer threads is bounded.
Real preprocess servers on the tiny model, and the tokenizer threads on its own. No timings are
asserted here (bench/bench_preprocess_flood.py measures them)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.errors import ResourceExhausted
from llmserve.preprocess.tokenizer_threads import TokenizerThreads
from llmserve.v1 import preprocess_pb2, preprocess_pb2_grpc
from tests.procs import running_service
from tests.rich_status import field_violation, retry_delay_ms

TEN_MB = 10 * 1024 * 1024
NORMAL = preprocess_pb2.PreprocessRequest(request_id="normal", prompt="The capital of France is", max_tokens=8)


def _send_concurrently(address: str, requests: list[preprocess_pb2.PreprocessRequest]) -> list:
    """Each request on its own thread at once; a response or the RpcError, in order."""
    with grpc.insecure_channel(address) as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)

        def send(request):
            try:
                return stub.Preprocess(request, timeout=120)
            except grpc.RpcError as error:
                return error

        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            return list(pool.map(send, requests))


def _assert_serving(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        ([], grpc.StatusCode.RESOURCE_EXHAUSTED),  # the receive limit, sized from the derived cap
        (["--max-prompt-bytes", str(TEN_MB - 1)], grpc.StatusCode.INVALID_ARGUMENT),  # the cap itself
    ],
    ids=["over-the-receive-limit", "over-the-byte-cap"],
)
def test_four_10_mb_prompts_are_refused_beside_a_normal_request(tiny_model_dir, tmp_path, flags, refusal):
    with running_service("preprocess", ["--model", str(tiny_model_dir), *flags], tmp_path) as service:
        huge = [preprocess_pb2.PreprocessRequest(request_id=f"huge-{i}", prompt="a" * TEN_MB) for i in range(4)]
        *refused, normal = _send_concurrently(service.address, [*huge, NORMAL])
        for error in refused:
            assert isinstance(error, grpc.RpcError) and error.code() == refusal, error
            if refusal == grpc.StatusCode.INVALID_ARGUMENT:
                assert field_violation(error) == (
                    "prompt", f"{TEN_MB} bytes exceeds the limit of {TEN_MB - 1} bytes; not tokenized"
                )
            else:
                assert error.details().startswith(f"request: {huge[0].ByteSize()} bytes exceeds the limit of ")
        assert isinstance(normal, preprocess_pb2.PreprocessResponse), normal
        assert len(normal.token_ids) > 0 and normal.max_tokens == 8
        _assert_serving(service.address)
    assert "Traceback" not in (tmp_path / "preprocess.log").read_text()


def test_a_flood_of_long_legal_prompts_is_refused_with_a_retry_delay_or_served(tiny_model_dir, tmp_path):
    # One worker and room for about one long prompt: the others that arrive while it tokenizes
    # are refused; which ones depends on timing, so each outcome is checked, not their count.
    flags = ["--model", str(tiny_model_dir), "--tokenizer-threads", "1", "--max-prompt-bytes", "2000000",
             "--max-in-flight-prompt-bytes", "1500000"]
    with running_service("preprocess", flags, tmp_path) as service:
        long = [preprocess_pb2.PreprocessRequest(request_id=f"long-{i}", prompt="word " * 200_000) for i in range(8)]
        *outcomes, normal = _send_concurrently(service.address, [*long, NORMAL])
        for outcome in outcomes:
            assert isinstance(outcome, grpc.RpcError), outcome  # far more tokens than the context
            if outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert retry_delay_ms(outcome) >= 1
                assert "prompt bytes" in outcome.details()
            else:
                assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT, outcome.details()
                assert field_violation(outcome)[1].endswith("exceeds the model context of 256 tokens")
        # A normal request is refused only while the budget is full, and then with a delay.
        if isinstance(normal, grpc.RpcError):
            assert normal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_delay_ms(normal) >= 1
        _assert_serving(service.address)
        [after] = _send_concurrently(service.address, [NORMAL])
        assert isinstance(after, preprocess_pb2.PreprocessResponse), after


async def test_the_worker_pool_admits_by_bytes_held_and_always_admits_when_idle():
    pool = TokenizerThreads(num_tokenizer_threads=1, max_in_flight_bytes=100)
    release = threading.Event()
    try:
        held = asyncio.create_task(pool.run(60, release.wait))
        await asyncio.sleep(0)  # admitted: it holds 60 of the 100 bytes
        with pytest.raises(ResourceExhausted) as refused:
            await pool.run(41, sum, [1])
        assert refused.value.retry_after_ms >= 1
        assert refused.value.message.startswith("preprocess is holding 60 prompt bytes (limit 100)")
        fits = asyncio.create_task(pool.run(40, sum, [1, 2]))  # waits behind the held one
        release.set()
        assert await held is True and await fits == 3
        assert await pool.run(500, sum, [4]) == 4  # over the budget, but nothing else is in flight
        with pytest.raises(ZeroDivisionError):  # an error frees its bytes too
            await pool.run(100, lambda: 1 / 0)
        assert await pool.run(100, sum, [5]) == 5
    finally:
        release.set()
        pool.close()

"""Micro-batching: jobs that arrive while the tokenizer threads are busy run as one batch, each job gets its
own result or error, a small job alone at light load runs on the event loop, and a server answering
many concurrent requests in batches answers each exactly as it answers it alone. Real tokenizer
threads, a real server on the tiny model."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from llmserve.preprocess import tokenizer_threads
from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocess.micro_batcher import MicroBatcher
from llmserve.preprocess.server import start_server
from llmserve.preprocess.tokenizer_threads import TokenizerThreads
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")

HANG_GUARD_S = 30.0  # only a broken batcher waits this long


async def test_jobs_queued_behind_a_busy_worker_run_as_one_batch_with_their_own_outcomes():
    first_running, release = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def square_batch(jobs):
        batches.append(list(jobs))
        if len(batches) == 1:
            first_running.set()
            release.wait(HANG_GUARD_S)
        return [ValueError(f"no {job}") if job == 3 else job * job for job in jobs]

    pool = TokenizerThreads(num_tokenizer_threads=1, max_in_flight_bytes=1000)
    batcher = MicroBatcher(pool, square_batch, max_batch_jobs=4)
    try:
        first = asyncio.create_task(batcher.run(0, 1))
        # The first job runs alone at once (nothing waits for a batch to fill): its worker says so.
        assert await asyncio.to_thread(first_running.wait, HANG_GUARD_S)
        queued = [asyncio.create_task(batcher.run(job, 1)) for job in range(1, 7)]
        cancelled = asyncio.create_task(batcher.run(99, 1))
        # One turn of the loop runs each new task up to its await (tasks start in creation
        # order): every job is queued behind the busy worker before the cancel and the release.
        await asyncio.sleep(0)
        cancelled.cancel()
        release.set()
        assert await first == 0
        outcomes = await asyncio.gather(*queued, return_exceptions=True)
        assert outcomes[:2] == [1, 4] and str(outcomes[2]) == "no 3" and outcomes[3:] == [16, 25, 36]
        assert batches == [[0], [1, 2, 3, 4], [5, 6]]  # the cancelled job never ran
    finally:
        release.set()
        pool.close()


def _where() -> int:
    return threading.get_ident()


def _refuse() -> int:
    raise ValueError(f"refused on {threading.get_ident()}")


async def test_a_small_call_alone_runs_on_the_loop_and_anything_else_on_a_thread(monkeypatch):
    loop_thread = threading.get_ident()
    monkeypatch.setattr(tokenizer_threads, "INLINE_IDLE_S", 3600.0)  # "started recently" whatever the machine's pace
    pools = [TokenizerThreads(num_tokenizer_threads=1, max_in_flight_bytes=1000, inline_max_bytes=100) for _ in range(4)]
    never = TokenizerThreads(num_tokenizer_threads=1, max_in_flight_bytes=1000, inline_max_bytes=0)
    try:
        first, small_alone, too_large, beside_another = pools
        with first.hold(100):
            assert await first.execute(100, _where) == loop_thread  # nothing started before it
        with first.hold(10):
            assert await first.execute(10, _where) != loop_thread  # a call started within the idle gap
        assert first.num_inline_calls == 1

        with small_alone.hold(1), pytest.raises(ValueError, match=f"refused on {loop_thread}"):
            await small_alone.execute(1, _refuse)  # its own error, raised on the loop
        with too_large.hold(101):
            assert await too_large.execute(101, _where) != loop_thread
        with beside_another.hold(5), beside_another.hold(10):  # another request's bytes are held
            assert await beside_another.execute(10, _where) != loop_thread
        with never.hold(1):
            assert await never.execute(1, _where) != loop_thread
        assert [p.num_inline_calls for p in (*pools, never)] == [1, 1, 0, 0, 0]
    finally:
        for pool in (*pools, never):
            pool.close()


async def test_a_job_arriving_while_another_runs_is_batched_on_a_thread_and_one_alone_runs_on_the_loop():
    first_running, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def negate_batch(jobs):
        seen.append(threading.get_ident())
        if len(seen) == 1:
            first_running.set()
            release.wait(HANG_GUARD_S)
        return [-job for job in jobs]

    pool = TokenizerThreads(num_tokenizer_threads=1, max_in_flight_bytes=1000, inline_max_bytes=100)
    batcher = MicroBatcher(pool, negate_batch, max_batch_jobs=4)

    async def run(job, num_bytes):
        with pool.hold(num_bytes):  # as the pipeline holds a request's bytes
            return await batcher.run(job, num_bytes)

    try:
        first = asyncio.create_task(run(1, 101))  # too large to run on the loop
        assert await asyncio.to_thread(first_running.wait, HANG_GUARD_S)
        second = asyncio.create_task(run(2, 1))  # small, but the first is running: it queues
        await asyncio.sleep(0)
        release.set()
        assert (await first, await second) == (-1, -2)
        assert threading.get_ident() not in seen and pool.num_inline_calls == 0
        await asyncio.sleep(tokenizer_threads.INLINE_IDLE_S * 2)
        assert await run(3, 1) == -3  # alone, after the idle gap: on the loop
        assert seen[-1] == threading.get_ident() and pool.num_inline_calls == 1
    finally:
        release.set()
        pool.close()


def _requests() -> list[preprocess_pb2.PreprocessRequest]:
    """Prompts, chats (shared system prompts, growing turns), token ids, and requests that fail
    after tokenizing (over the context) or in the template."""
    requests = []
    for i in range(40):
        kind = i % 5
        if kind == 0:
            requests.append(preprocess_pb2.PreprocessRequest(prompt=f"The capital of France is {i} Paris " * (1 + i % 7)))
        elif kind in (1, 2):
            turns = [common_pb2.ChatMessage(role="system", content=f"Be brief {i % 3}")]
            for turn in range(i % 4 + 1):
                turns.append(common_pb2.ChatMessage(role="user", content=f"question {turn} é 東京"))
                turns.append(common_pb2.ChatMessage(role="assistant", content=f"answer {turn}\n\n"))
            requests.append(preprocess_pb2.PreprocessRequest(chat=common_pb2.ChatInput(messages=turns[:-1])))
        elif kind == 3:
            requests.append(preprocess_pb2.PreprocessRequest(prompt_token_ids=common_pb2.TokenIdsInput(token_ids=range(i, i + 30))))
        else:
            requests.append(preprocess_pb2.PreprocessRequest(prompt="x" * (300 + i)))  # over the 256-token context
    return requests


async def _answer(stub, request):
    try:
        response = await stub.Preprocess(request, timeout=60)
    except grpc.aio.AioRpcError as error:
        return (error.code(), error.details())
    response.ClearField("preprocess_time_ns")
    return response


async def test_batched_answers_equal_the_answers_to_each_request_alone(tiny_model_dir):
    alone_config = PreprocessConfig(model_path=tiny_model_dir, port=0, num_tokenizer_threads=1, max_batch_prompts=1, prompt_cache_bytes=0)
    batched_config = PreprocessConfig(model_path=tiny_model_dir, port=0, num_tokenizer_threads=1, max_batch_prompts=16)
    servers = [await start_server(alone_config), await start_server(batched_config)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}", options=CHANNEL_OPTIONS) for s in servers]
    try:
        alone, batched = (preprocess_pb2_grpc.PreprocessServiceStub(c) for c in channels)
        requests = _requests()
        expected = [await _answer(alone, request) for request in requests]
        for _ in range(3):  # the later rounds meet the prefixes the first stored
            assert await asyncio.gather(*(_answer(batched, r) for r in requests)) == expected
        assert sum(isinstance(e, tuple) for e in expected) == 8
        assert all(e[0] == grpc.StatusCode.INVALID_ARGUMENT for e in expected if isinstance(e, tuple))
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.running.server.stop(1.0)
            await server.close()


async def test_the_inline_size_is_a_flag_with_a_default_and_a_negative_one_is_refused(tiny_model_dir):
    from llmserve.preprocess.__main__ import build_parser, config_from_args

    def config(*flags):
        return config_from_args(build_parser().parse_args(["--model", str(tiny_model_dir), *flags]))

    assert config().inline_max_prompt_bytes == 8192
    assert config("--inline-max-prompt-bytes", "0").inline_max_prompt_bytes == 0
    with pytest.raises(ValueError, match="inline_max_prompt_bytes must not be negative"):
        config("--inline-max-prompt-bytes", "-1")

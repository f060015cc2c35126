"""Micro-batching: jobs that arrive while the tokenizer threads are busy run as one batch, each job gets its
own result or error, a small job alone at light load runs on the event loop, and a server answering
many concurrent requests in batches answers each exactly as it answers it alone. Real tokenizer
threads, a real server on the tiny model."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from llmserve.preprocess import micro_batcher
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


def _thread_recording_batch(threads_seen: list[int]):
    def negate_batch(jobs):
        threads_seen.append(threading.get_ident())
        return [ValueError(f"no {job}") if job == 3 else -job for job in jobs]
    return negate_batch


async def test_a_small_job_alone_runs_on_the_loop_and_anything_else_on_a_thread(monkeypatch):
    loop_thread = threading.get_ident()
    seen: list[int] = []
    pool = TokenizerThreads(num_tokenizer_threads=1, max_in_flight_bytes=1000)
    try:
        batcher = MicroBatcher(pool, _thread_recording_batch(seen), max_batch_jobs=4, inline_max_bytes=100)
        monkeypatch.setattr(micro_batcher, "INLINE_IDLE_S", 3600.0)  # "started recently" whatever the machine's pace
        assert await batcher.run(1, 100) == -1  # the first job: nothing started before it
        assert seen == [loop_thread] and batcher.num_inline_jobs == 1
        assert await batcher.run(2, 10) == -2  # another job started within the idle gap: a thread
        assert seen[-1] != loop_thread

        fresh = MicroBatcher(pool, _thread_recording_batch(seen), max_batch_jobs=4, inline_max_bytes=100)
        assert await fresh.run(4, 101) == -4  # over the size: a thread
        assert seen[-1] != loop_thread and fresh.num_inline_jobs == 0

        alone = MicroBatcher(pool, _thread_recording_batch(seen), max_batch_jobs=4, inline_max_bytes=100)
        with pytest.raises(ValueError, match="no 3"):  # a job's own error, raised on the loop
            await alone.run(3, 1)
        assert seen[-1] == loop_thread and alone.num_inline_jobs == 1

        never = MicroBatcher(pool, _thread_recording_batch(seen), max_batch_jobs=4, inline_max_bytes=0)
        assert await never.run(5, 0) == -5
        assert seen[-1] != loop_thread and never.num_inline_jobs == 0
    finally:
        pool.close()


async def test_a_job_arriving_while_another_runs_is_not_run_on_the_loop():
    first_running, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def slow_first(jobs):
        seen.append(threading.get_ident())
        if len(seen) == 1:
            first_running.set()
            release.wait(HANG_GUARD_S)
        return [-job for job in jobs]

    pool = TokenizerThreads(num_tokenizer_threads=1, max_in_flight_bytes=1000)
    batcher = MicroBatcher(pool, slow_first, max_batch_jobs=4, inline_max_bytes=100)
    try:
        first = asyncio.create_task(batcher.run(1, 101))  # too large to run inline: a thread
        assert await asyncio.to_thread(first_running.wait, HANG_GUARD_S)
        second = asyncio.create_task(batcher.run(2, 1))  # small, but a job is running: it queues
        await asyncio.sleep(0)
        release.set()
        assert (await first, await second) == (-1, -2)
        assert threading.get_ident() not in seen and batcher.num_inline_jobs == 0
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

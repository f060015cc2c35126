"""Micro-batches of tokenizer jobs on the tokenizer threads: one call into Rust for many requests.

Jobs queue on the event loop; whenever a tokenizer thread is free, everything queued (up to
`max_batch_jobs`) leaves as one batch, so nothing ever waits for a batch to fill: alone, a job
runs at once as a batch of one; under load, the jobs that arrived while every tokenizer thread was busy
run together. A batch pays the thread hand-off, the GIL release and the wake-up once instead of
per request, and `encode_batch` spreads it over the tokenizer's own threads. At most
`num_tokenizer_threads` batches run at a time. Admission (the byte budget) is the caller's: a job is
queued only once its bytes are held (`TokenizerThreads.hold`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from llmserve.preprocess.tokenizer_threads import TokenizerThreads
from llmserve.request_context import context_without_request

J = TypeVar("J")
R = TypeVar("R")

# What a batch function returns per job: its result, or the exception that job raises.
BatchFn = Callable[[Sequence[J]], list["R | Exception"]]


@dataclass(slots=True)
class _Queued(Generic[J, R]):
    job: J
    num_bytes: int
    future: asyncio.Future


class MicroBatcher(Generic[J, R]):
    """Runs `batch_fn` over queued jobs on `threads`. Use from one event loop."""

    def __init__(self, threads: TokenizerThreads, batch_fn: BatchFn, *, max_batch_jobs: int):
        self._threads = threads
        self._batch_fn = batch_fn
        self._max_batch_jobs = max_batch_jobs
        self._queue: deque[_Queued[J, R]] = deque()
        self._num_running = 0
        self._tasks: set[asyncio.Task] = set()

    async def run(self, job: J, num_bytes: int) -> R:
        """`job`'s result once its batch has run; raises what the batch function gave it."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(job, num_bytes, future))
        self._dispatch()
        return await future  # a cancelled caller's job is skipped, or its result dropped

    def _dispatch(self) -> None:
        while self._queue and self._num_running < self._threads.num_tokenizer_threads:
            batch = self._take_batch()
            if not batch:
                return
            self._num_running += 1
            # A batch serves many requests: its lines are labelled with none of them.
            task = asyncio.get_running_loop().create_task(self._run_batch(batch), context=context_without_request())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take_batch(self) -> list[_Queued[J, R]]:
        batch = []
        while self._queue and len(batch) < self._max_batch_jobs:
            queued = self._queue.popleft()
            if not queued.future.done():
                batch.append(queued)
        return batch

    async def _run_batch(self, batch: list[_Queued[J, R]]) -> None:
        try:
            jobs = [queued.job for queued in batch]
            num_bytes = sum(queued.num_bytes for queued in batch)
            outcomes = await self._threads.execute(num_bytes, lambda: self._batch_fn(jobs))
        except Exception as exc:  # the batch function itself failed: every job sees it
            outcomes = [exc] * len(batch)
        finally:
            self._num_running -= 1
            self._dispatch()
        for queued, outcome in zip(batch, outcomes, strict=True):
            if queued.future.done():
                continue
            if isinstance(outcome, Exception):
                queued.future.set_exception(outcome)
            else:
                queued.future.set_result(outcome)

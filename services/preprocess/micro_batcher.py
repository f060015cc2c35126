"""Micro-batches of tokenizer jobs on the tokenizer threads: one call into Rust for many requests.

Jobs queue on the event loop; whenever a tokenizer thread is free, everything queued (up to
`max_batch_jobs`) leaves as one batch, so nothing ever waits for a batch to fill: alone, a job
runs at once as a batch of one; under load, the jobs that arrived while every tokenizer thread was busy
run together. A batch pays the thread hand-off, the GIL release and the wake-up once instead of
per request, and `encode_batch` spreads it over the tokenizer's own threads. At most
`num_tokenizer_threads` batches run at a time. Admission (the byte budget) is the caller's: a job is
queued only once its bytes are held (`TokenizerThreads.hold`).

At light load a small job runs on the event loop itself (`inline_max_bytes`): when nothing is
queued or running and no job started in the last `INLINE_IDLE_S`, the hand-off to a thread and
the wake-up back are a large part of a short prompt's time at preprocess, on the first token's
path (a 512-token prompt alone: the gateway's round trip 2.77 against 3.09 ms, medians of 8
interleaved runs; docs/benchmarks.md, "Twelfth session"). Under load jobs keep going to the threads, which tokenize in
parallel while the loop serves.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from llmserve.preprocess.tokenizer_threads import TokenizerThreads
from llmserve.request_context import context_without_request

J = TypeVar("J")
R = TypeVar("R")

# What a batch function returns per job: its result, or the exception that job raises.
BatchFn = Callable[[Sequence[J]], list["R | Exception"]]

# A job runs on the loop only if none started this recently: arrivals further apart than this leave
# the loop idle most of the time, so a ~1 ms tokenization there delays little else.
INLINE_IDLE_S = 0.005


@dataclass(slots=True)
class _Queued(Generic[J, R]):
    job: J
    num_bytes: int
    future: asyncio.Future


class MicroBatcher(Generic[J, R]):
    """Runs `batch_fn` over queued jobs on `threads`. Use from one event loop."""

    def __init__(self, threads: TokenizerThreads, batch_fn: BatchFn, *, max_batch_jobs: int, inline_max_bytes: int = 0):
        self._threads = threads
        self._batch_fn = batch_fn
        self._max_batch_jobs = max_batch_jobs
        self._inline_max_bytes = inline_max_bytes  # 0: every job goes to a tokenizer thread
        self._queue: deque[_Queued[J, R]] = deque()
        self._num_running = 0
        self._tasks: set[asyncio.Task] = set()
        self._last_start_s = -float("inf")  # when the latest job started, inline or on a thread
        self.num_inline_jobs = 0

    async def run(self, job: J, num_bytes: int) -> R:
        """`job`'s result once its batch has run; raises what the batch function gave it."""
        if self._is_alone_and_small(num_bytes):
            return self._run_inline(job, num_bytes)
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(job, num_bytes, future))
        self._dispatch()
        return await future  # a cancelled caller's job is skipped, or its result dropped

    def _is_alone_and_small(self, num_bytes: int) -> bool:
        return (
            0 < num_bytes <= self._inline_max_bytes
            and not self._queue
            and self._num_running == 0
            and time.monotonic() - self._last_start_s >= INLINE_IDLE_S
        )

    def _run_inline(self, job: J, num_bytes: int) -> R:
        self._last_start_s = time.monotonic()
        self.num_inline_jobs += 1
        (outcome,) = self._threads.run_here(num_bytes, lambda: self._batch_fn([job]))
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _dispatch(self) -> None:
        while self._queue and self._num_running < self._threads.num_tokenizer_threads:
            batch = self._take_batch()
            if not batch:
                return
            self._last_start_s = time.monotonic()
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

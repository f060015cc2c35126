"""The tokenizer threads preprocess runs its pipeline on, and the bound on what waits for them.

Tokenizing is CPU work in Rust that releases the GIL, so it runs on `num_tokenizer_threads` threads while
the event loop keeps serving. What waits for a thread is bounded by bytes, not by count: every
admitted request holds its prompt until it finishes, and admission counts the prompt's bytes
against `max_in_flight_bytes`. A request that does not fit is refused at once with
RESOURCE_EXHAUSTED and a RetryInfo delay (the bytes ahead of it over the measured tokenizing
rate), so a flood of long but legal prompts cannot grow memory without bound, while short
prompts still fit beside long ones. Refusing rather than queueing without end lets the client
(or a balancer) retry elsewhere with an honest hint. A request is always admitted when nothing
is in flight, so the budget never refuses a prompt the byte cap allows.

At light load a small call runs on the event loop itself (`inline_max_bytes`): when its bytes are
the only ones held (nothing else waits or runs) and no call started in the last `INLINE_IDLE_S`,
the hand-off to a thread and the wake-up back are a large part of a short prompt's time at
preprocess, on the first token's path (a 512-token prompt alone: the gateway's round trip 2.77
against 3.09 ms, medians of 8 interleaved rounds; docs/benchmarks.md, "Twelfth session"). Under
load calls keep going to the threads, which tokenize in parallel while the loop serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

from llmserve.errors import ResourceExhausted

T = TypeVar("T")

# One tokenizer thread's tokenizing rate before anything was measured (tokenizers does ~1-5 MB/s a thread).
_INITIAL_BYTES_PER_S = 2_000_000.0
# Weight of the newest measurement in the rate's moving average.
_RATE_SMOOTHING = 0.2
# A call runs on the loop only if none started this recently: arrivals further apart than this
# leave the loop idle most of the time, so a ~1 ms tokenization there delays little else.
INLINE_IDLE_S = 0.005


class TokenizerThreads:
    """Runs blocking pipeline calls on tokenizer threads, within a byte budget. Use from one event
    loop: the accounting is done on the loop thread, never on the threads."""

    def __init__(self, num_tokenizer_threads: int, max_in_flight_bytes: int, inline_max_bytes: int = 0):
        self._executor = ThreadPoolExecutor(max_workers=num_tokenizer_threads, thread_name_prefix="preprocess")
        self.num_tokenizer_threads = num_tokenizer_threads
        self._max_in_flight_bytes = max_in_flight_bytes
        self._inline_max_bytes = inline_max_bytes  # 0: every call goes to a tokenizer thread
        self._in_flight_bytes = 0  # prompts admitted and not finished (waiting or running)
        self._bytes_per_s = _INITIAL_BYTES_PER_S  # one tokenizer thread's, moving average
        self._last_start_s = -math.inf  # when the latest call started, here or on a thread
        self.num_inline_calls = 0

    async def run(self, num_bytes: int, fn: Callable[..., T], /, *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on a tokenizer thread, holding `num_bytes` of the budget meanwhile;
        ResourceExhausted (with a retry delay) when they do not fit."""
        with self.hold(num_bytes):
            return await self.execute(num_bytes, functools.partial(fn, *args, **kwargs))

    @contextlib.contextmanager
    def hold(self, num_bytes: int) -> Iterator[None]:
        """Admit `num_bytes` for the duration of the block, or raise ResourceExhausted."""
        self._admit(num_bytes)
        try:
            yield
        finally:
            self._in_flight_bytes -= num_bytes

    async def execute(self, num_bytes: int, fn: Callable[[], T]) -> T:
        """`fn()` on a tokenizer thread, or on the loop when alone and small (no admission: the caller
        holds the bytes), timed into the rate estimate as work on `num_bytes` of prompts."""
        if self._is_alone_and_small(num_bytes):
            return self._run_here(num_bytes, fn)
        self._last_start_s = time.monotonic()
        elapsed_s: list[float] = []  # set by the tokenizer thread when fn returns or raises

        def timed() -> T:
            start_s = time.perf_counter()
            try:
                return fn()
            finally:
                elapsed_s.append(time.perf_counter() - start_s)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, timed)
        finally:
            if elapsed_s:  # empty when the caller was cancelled before fn finished
                self._measure(num_bytes, elapsed_s[0])

    def _is_alone_and_small(self, num_bytes: int) -> bool:
        return (
            0 < num_bytes <= self._inline_max_bytes
            and self._in_flight_bytes == num_bytes  # only the caller's bytes are held
            and time.monotonic() - self._last_start_s >= INLINE_IDLE_S
        )

    def _run_here(self, num_bytes: int, fn: Callable[[], T]) -> T:
        self._last_start_s = time.monotonic()
        self.num_inline_calls += 1
        start_s = time.perf_counter()  # the clock execute's threads time fn with
        try:
            return fn()
        finally:
            self._measure(num_bytes, time.perf_counter() - start_s)

    def close(self) -> None:
        """Stop the tokenizer threads (after the gRPC server has stopped)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _admit(self, num_bytes: int) -> None:
        if self._in_flight_bytes and self._in_flight_bytes + num_bytes > self._max_in_flight_bytes:
            raise ResourceExhausted(
                f"preprocess is holding {self._in_flight_bytes} prompt bytes (limit "
                f"{self._max_in_flight_bytes}); a prompt of {num_bytes} bytes does not fit, retry later",
                retry_after_ms=self._drain_time_ms(),
            )
        self._in_flight_bytes += num_bytes

    def _drain_time_ms(self) -> int:
        return max(1, math.ceil(1000 * self._in_flight_bytes / (self._bytes_per_s * self.num_tokenizer_threads)))

    def _measure(self, num_bytes: int, elapsed_s: float) -> None:
        rate = num_bytes / max(elapsed_s, 1e-6)
        self._bytes_per_s += _RATE_SMOOTHING * (rate - self._bytes_per_s)

"""BatchedHistogram: observations counted in plain Python, added to a Prometheus histogram in
batches.

Why: a histogram observed per token (the gateway's inter-token latency) pays prometheus-client's
observe at every message, and with several workers (multiprocess mode) each observe writes two
values to a memory-mapped file under a lock: 2.2 µs measured, against ~0.9 µs in one process and
~0.3 µs for the counting here. The batch is added when it holds `max_pending` observations, when
`max_age_s` passed since the last addition (checked at each observe) and on `flush` (a request's
end), so a scrape lags the traffic by at most that, and never once the traffic stops.
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import Histogram

DEFAULT_MAX_PENDING = 1024
DEFAULT_MAX_AGE_S = 1.0


class BatchedHistogram:
    """`observe(value, count)` as the histogram's own observe would, `count` times; not thread-safe
    (one per event loop: each gateway worker has its own)."""

    def __init__(self, histogram: Histogram, *, max_pending: int = DEFAULT_MAX_PENDING,
                 max_age_s: float = DEFAULT_MAX_AGE_S):
        self._histogram = histogram
        # Prometheus buckets are "le": a value equal to a bound counts in that bound's bucket,
        # which is what bisect_left finds. The last bound is +Inf.
        self._upper_bounds = histogram._upper_bounds
        self._max_pending = max_pending
        self._max_age_s = max_age_s
        self._counts = [0] * len(self._upper_bounds)
        self._sum = 0.0
        self._num_pending = 0
        self._flushed_s = time.monotonic()

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect_left(self._upper_bounds, value)] += count
        self._sum += value * count
        self._num_pending += count
        if self._num_pending >= self._max_pending or time.monotonic() - self._flushed_s >= self._max_age_s:
            self.flush()

    def flush(self) -> None:
        """Add what was observed since the last flush to the histogram."""
        self._flushed_s = time.monotonic()
        if not self._num_pending:
            return
        # prometheus-client's own Histogram.observe does exactly these increments, per value.
        for bucket, count in zip(self._histogram._buckets, self._counts):
            if count:
                bucket.inc(count)
        self._histogram._sum.inc(self._sum)
        self._counts = [0] * len(self._upper_bounds)
        self._sum = 0.0
        self._num_pending = 0

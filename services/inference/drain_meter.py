"""DrainMeter: how fast something drains, per second of the time it had something to drain.

An exponential moving average with a time constant, not a sample count, so a burst of tiny
intervals (one per engine step) weighs what a few long ones do. Time counts only while the
meter is told it is busy: idle time would dilute the rate into the arrival rate, which says
nothing about what the engine can do.
"""

from __future__ import annotations

import math

EMA_TAU_S = 5.0  # recent history: a rate ~5 s old has weight 1/e
MIN_SAMPLE_S = 0.2  # shorter windows (one fast step) are folded into the next sample


class DrainMeter:
    def __init__(self, now_ns: int):
        self.per_s: float | None = None  # None until the first full sample
        self._last_ns = now_ns
        self._window_amount = 0.0
        self._window_s = 0.0

    def advance(self, now_ns: int, *, was_busy: bool) -> None:
        """Close the interval since the last call, during which the meter was busy or not."""
        if was_busy:
            self._window_s += (now_ns - self._last_ns) / 1e9
        self._last_ns = now_ns

    def add(self, drained: float) -> None:
        """What drained in the intervals closed so far; a window long enough becomes a sample."""
        self._window_amount += drained
        if self._window_s >= MIN_SAMPLE_S:
            self._fold(self._window_amount / self._window_s, self._window_s)
            self._window_amount, self._window_s = 0.0, 0.0

    def _fold(self, sample: float, duration_s: float) -> None:
        if self.per_s is None:
            self.per_s = sample
            return
        weight = 1.0 - math.exp(-duration_s / EMA_TAU_S)
        self.per_s += weight * (sample - self.per_s)


class StepTimer:
    """The time of one engine step: the interval between two deliveries of tokens while a
    request was producing (an EMA with the same time constant)."""

    def __init__(self, now_ns: int):
        self.step_s: float | None = None
        self._last_ns = now_ns

    def advance(self, now_ns: int, *, was_producing: bool, has_tokens: bool) -> None:
        if not has_tokens:
            return
        if was_producing:
            interval_s = (now_ns - self._last_ns) / 1e9
            if self.step_s is None:
                self.step_s = interval_s
            else:
                self.step_s += (1.0 - math.exp(-interval_s / EMA_TAU_S)) * (interval_s - self.step_s)
        self._last_ns = now_ns

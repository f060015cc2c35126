"""How fast a replica drains, measured from the outputs it delivers. Pure Python.

Both meters are exponential moving averages with a time constant, not a sample count, so a
burst of tiny intervals (one per engine step) weighs what a few long ones do.

  DrainMeter  an amount drained per second of the time the meter was busy: idle time would
              dilute the rate into the arrival rate, which says nothing about the engine;
  StepPace    per delivery (one per engine step): the step time and the batch it was measured
              at (sequences that produced a token), and the prompt tokens started
              (first token produced) per second of the steps that started any. Steps that
              started none are left out on purpose: a request that arrived mid-step has to wait
              for the next one, which says nothing about how fast a queue is worked through.
"""

from __future__ import annotations

import math

EMA_TAU_S = 5.0  # recent history: a value ~5 s old has weight 1/e
MIN_SAMPLE_S = 0.2  # DrainMeter: shorter windows (one fast step) are folded into the next sample


def _ema(current: float | None, sample: float, duration_s: float) -> float:
    if current is None:
        return sample
    return current + (1.0 - math.exp(-duration_s / EMA_TAU_S)) * (sample - current)


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
            self.per_s = _ema(self.per_s, self._window_amount / self._window_s, self._window_s)
            self._window_amount, self._window_s = 0.0, 0.0


class StepPace:
    def __init__(self, now_ns: int):
        self.step_s: float | None = None
        self.batch_size: float | None = None  # sequences per step, where step_s was measured
        self.prefill_tokens_per_s: float | None = None
        self.step_started_ns = now_ns  # the previous delivery, or when the engine got busy

    def start(self, now_ns: int) -> None:
        """The engine was idle and got work: its next step starts now."""
        self.step_started_ns = now_ns

    def running_step_s(self, now_ns: int) -> float:
        return (now_ns - self.step_started_ns) / 1e9

    def advance(self, now_ns: int, *, num_token_outputs: int, num_started_prompt_tokens: int) -> None:
        """One delivery: a step ended, in which `num_token_outputs` sequences produced tokens."""
        interval_s = self.running_step_s(now_ns)
        if interval_s > 0 and num_started_prompt_tokens:
            sample = num_started_prompt_tokens / interval_s
            self.prefill_tokens_per_s = _ema(self.prefill_tokens_per_s, sample, interval_s)
        if num_token_outputs:
            self.step_s = _ema(self.step_s, interval_s, interval_s)
            self.batch_size = _ema(self.batch_size, num_token_outputs, interval_s)
        self.step_started_ns = now_ns

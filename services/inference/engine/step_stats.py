"""Per-step measurements of the torch engine, taken by the engine itself when asked
(TorchEngineCore(step_stats=StepStatsLog(...))): host time per part of a step, the batch size,
and optionally the device time of the step's work from CUDA events. Off, a step pays nothing
but a few no-op calls. Benchmarks read them; metrics (step time, batch size) can later.

With async scheduling the host parts of step N+1 overlap the device's work on step N, so they
can add up to more than the time the device waits for the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


# The host parts of a step, in the order a step runs them (StepStats fields, less "_s").
HOST_PARTS = ("schedule", "inputs", "execute_launch", "sampler_launch", "result_wait", "update", "record")


@dataclass(slots=True)
class StepStats:
    """One call of step(). Host seconds; the batch is the one the call launched (none: 0)."""

    num_seqs: int = 0
    num_tokens: int = 0  # tokens the batch computes (prefill chunks + decodes)
    step_s: float = 0.0  # the whole call
    schedule_s: float = 0.0  # Scheduler.schedule
    inputs_s: float = 0.0  # the step's flat inputs on the host (batch_inputs.build_step_inputs)
    execute_launch_s: float = 0.0  # queueing the forward (ModelRunner.execute: staging, metadata, launch)
    sampler_launch_s: float = 0.0  # queueing the sampling (Sampler.launch)
    result_wait_s: float = 0.0  # waiting for sampled tokens on the host: the step's one sync
    update_s: float = 0.0  # the sampled tokens into the sequences, stop rules, one output per token
    record_s: float = 0.0  # Scheduler.record_launch: placeholders, computed counts, prefix cache
    # CUDA events recorded before the forward and after the sampling is queued (measure_gpu).
    gpu_begin: Any = None
    gpu_end: Any = None

    def gpu_busy_ms(self) -> float:
        """Device milliseconds between the two events (0 without them); valid once the device
        has passed the end event (after a synchronize: reading them adds no sync mid-run)."""
        if self.gpu_end is None:
            return 0.0
        return self.gpu_begin.elapsed_time(self.gpu_end)


@dataclass
class StepStatsLog:
    """Where the engine puts one StepStats per step() call."""

    measure_gpu: bool = False  # record CUDA events (on a CUDA device only)
    steps: list[StepStats] = field(default_factory=list)

    def record(self, stats: StepStats) -> None:
        self.steps.append(stats)


class StepTimer:
    """Fills one StepStats during a step() call and hands it to the log at the end."""

    def __init__(self, log: StepStatsLog, device: torch.device):
        self._log = log
        self._use_events = log.measure_gpu and device.type == "cuda"
        self._start = time.perf_counter()
        self.stats = StepStats()

    def measure(self, part: str, fn, *args):
        """fn(*args), its host seconds added to the StepStats field `part`."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            setattr(self.stats, part, getattr(self.stats, part) + time.perf_counter() - start)

    def gpu_begin(self) -> None:
        if self._use_events:
            self.stats.gpu_begin = _event()

    def gpu_end(self) -> None:
        if self._use_events:
            self.stats.gpu_end = _event()

    def done(self, num_seqs: int, num_tokens: int) -> None:
        self.stats.num_seqs, self.stats.num_tokens = num_seqs, num_tokens
        self.stats.step_s = time.perf_counter() - self._start
        self._log.record(self.stats)


class Untimed:
    """A StepTimer that measures nothing (step stats off)."""

    def measure(self, part: str, fn, *args):
        return fn(*args)

    def gpu_begin(self) -> None:
        pass

    def gpu_end(self) -> None:
        pass

    def done(self, num_seqs: int, num_tokens: int) -> None:
        pass


UNTIMED = Untimed()


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event

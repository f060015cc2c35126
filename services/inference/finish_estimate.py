"""How long a request would take if admitted now (admission's deadline check): the wait for the
prompt tokens ahead of it to start, then its max_tokens decode steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FinishEstimate:
    prompt_tokens_ahead: int
    prefill_tokens_per_s: float | None
    wait_s: float
    max_tokens: int
    step_s: float

    @property
    def total_s(self) -> float:
        return self.wait_s + self.max_tokens * self.step_s

    def describe(self) -> str:
        rate = self.prefill_tokens_per_s
        drain = "an unmeasured rate" if rate is None else f"{rate:.0f} tokens/s"
        return (
            f"{self.wait_s:.1f} s to start {self.prompt_tokens_ahead} prompt tokens at {drain}, then "
            f"{self.max_tokens} tokens at {self.step_s * 1000:.0f} ms per step of the batch it joins"
        )

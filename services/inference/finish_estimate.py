"""How long a request would take if admitted now (admission's deadline check), counted in the
engine's own steps.

StepSchedule: the steps ahead as the scheduler runs them (scheduler.py): every step computes
the decoding sequences first, then prompt chunks up to the token budget (--max-batched-tokens).
So while prompt tokens wait, every step is a *full* one, for the decodes as much as for the
prompts, and only once the queue is prefilled do steps shrink to decode steps:

    step 1 .. F            full: the decodes + a chunk of (budget - decodes) prompt tokens
    step F+1 ..            decode: one token per running sequence

A request whose prompt ends in step s, asking for m tokens, ends at step s + m - 1 (its last
prefill step samples its first token). Why in steps, not a prefill rate and a decode step
added up: on a CPU, where a full step of 2,048 tokens takes seconds, the decode steps of a
request admitted early in a burst are full steps as long as prompts queue behind it; adding its
prefill at a rate and its decode at the decode step's time estimated 6 s for requests that took
30 s (every admitted request of a 60-request burst missed a 10 s deadline). The same schedule
says what a new request does to those admitted before it (admission.py): it lengthens the full
phase their remaining steps fall in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ErrorInfo of a deadline refusal: its reason and domain (google.rpc.ErrorInfo), so a client
# reads the estimate from fields, not from the message.
DEADLINE_ESTIMATE_REASON = "DEADLINE_ESTIMATE"
ERROR_DOMAIN = "llmserve.dev"


@dataclass(frozen=True, slots=True)
class StepSchedule:
    full_step_s: float  # a step while prompt tokens wait: the decodes and a whole chunk
    last_full_step_s: float  # the last of them: the decodes and what is left of the queue
    decode_step_s: float  # a step once they are all computed
    chunk_tokens: int  # prompt tokens a full step computes
    num_full_steps: int  # until every waiting prompt token is computed
    # What is left of the step running now: every step ahead starts after it. (Left out, a
    # request admitted mid-step on the CPU, where a step with prompt chunks takes ~1 s, was
    # estimated a step short and ended 1-3 tokens short of max_tokens at its deadline.)
    in_progress_s: float = 0.0

    def steps_to_prefill(self, num_prompt_tokens_ahead: int) -> int:
        """The step in which a prompt ends that has this many waiting tokens ahead of its end (at
        least the next: a prompt found whole in the prefix cache still computes its last token)."""
        return max(1, math.ceil(num_prompt_tokens_ahead / self.chunk_tokens))

    def time_s(self, num_steps: int) -> float:
        """Until the end of step `num_steps` from now (the step in progress not counted)."""
        num_full = min(num_steps, self.num_full_steps)
        full_s = 0.0 if not num_full else (
            (num_full - 1) * self.full_step_s
            + (self.last_full_step_s if num_full == self.num_full_steps else self.full_step_s)
        )  # fmt: skip
        return self.in_progress_s + full_s + max(0, num_steps - num_full) * self.decode_step_s

    def describe(self) -> str:
        in_progress = f"{self.in_progress_s * 1000:.0f} ms left of the step in progress, " if self.in_progress_s else ""
        return (
            f"{in_progress}{self.num_full_steps} steps of {self.chunk_tokens} prompt tokens at {self.full_step_s * 1000:.0f} ms, "
            f"then decode steps of {self.decode_step_s * 1000:.0f} ms"
        )


@dataclass(frozen=True, slots=True)
class FinishEstimate:
    schedule: StepSchedule  # with the request admitted
    prompt_tokens_ahead: int  # waiting prompt tokens, its own included
    max_tokens: int
    batch: int  # sequences decoding with it
    sequences_beyond_batch: int  # in flight with its own, beyond --max-num-seqs
    sequence_finishes_per_s: float | None  # None: not measured yet
    alone_s: float  # on an idle replica: its own prefill, then its decode alone

    @property
    def prefill_steps(self) -> int:
        return self.schedule.steps_to_prefill(self.prompt_tokens_ahead)

    @property
    def prefill_wait_s(self) -> float:
        """Until its prompt is computed (its first token sampled)."""
        return self.schedule.time_s(self.prefill_steps)

    @property
    def slot_wait_s(self) -> float:
        """Until enough sequences ahead have finished for its own to run."""
        return drain_s(self.sequences_beyond_batch, self.sequence_finishes_per_s)

    @property
    def start_s(self) -> float:
        # Both drain at once: the queue is prefilled while the running batch finishes.
        return max(self.prefill_wait_s, self.slot_wait_s)

    @property
    def decode_s(self) -> float:
        """Its tokens after the first, from the step after its prefill."""
        return self.schedule.time_s(self.prefill_steps + self.max_tokens - 1) - self.prefill_wait_s

    @property
    def total_s(self) -> float:
        return self.start_s + self.decode_s

    def describe(self) -> str:
        slots = (
            f", {self.slot_wait_s:.1f} s for {self.sequences_beyond_batch} sequences beyond the running batch to finish"
            if self.sequences_beyond_batch else ""
        )  # fmt: skip
        return (
            f"{self.prefill_wait_s:.1f} s to compute the {self.prompt_tokens_ahead} prompt tokens ahead of its end in "
            f"{self.prefill_steps} steps{slots}, then {self.max_tokens} tokens in {self.decode_s:.1f} s, in the batch "
            f"of {self.batch} it joins: {self.schedule.describe()}"
        )

    def error_info(self, time_left_s: float) -> tuple[str, str, dict[str, str]]:
        """(reason, domain, metadata) of the refusal's ErrorInfo; times in milliseconds."""
        fields = {
            "estimated_ms": self.total_s, "time_left_ms": time_left_s, "start_ms": self.start_s,
            "prefill_wait_ms": self.prefill_wait_s, "slot_wait_ms": self.slot_wait_s, "decode_ms": self.decode_s,
            "full_step_ms": self.schedule.full_step_s, "last_full_step_ms": self.schedule.last_full_step_s,
            "decode_step_ms": self.schedule.decode_step_s, "in_progress_step_ms": self.schedule.in_progress_s,
        }  # fmt: skip
        metadata = {name: f"{seconds * 1000:.0f}" for name, seconds in fields.items()}
        metadata.update(prompt_tokens_ahead=str(self.prompt_tokens_ahead), batch=str(self.batch),
                        max_tokens=str(self.max_tokens))
        return DEADLINE_ESTIMATE_REASON, ERROR_DOMAIN, metadata


def drain_s(amount: float, per_s: float | None) -> float:
    return amount / per_s if amount and per_s else 0.0

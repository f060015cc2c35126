"""StepTimeModel: how long one engine step takes for the batch it runs, learnt from this
replica's own steps (so per device, model and host load). Pure Python.

    step_s ≈ base_s + per_seq_s x sequences + per_prompt_token_s x prompt tokens

where a step computes one token per sequence in it (a decode, or a prompt chunk's first) and
`prompt tokens` are the rest of its prompt chunks (tokens - sequences). Learnt in two parts, as
the steps show them:
  - the decode line (base_s, per_seq_s): a weighted least-squares line through the steps that
    computed one token per sequence, its slope kept at >= 0 and its base at >= 0;
  - the prompt token (per_prompt_token_s): a weighted ratio over the steps that carried prompt
    chunks: their time beyond the decode line's for their sequences, per prompt token.

Why two parts, not one least-squares fit of all three terms: the steps a burst runs are few and
alike (a prefill step has few sequences and many tokens, a decode step the reverse), so a joint
fit is ill-conditioned. On the CPU, steps of (1 sequence, 427 tokens, 1.03 s) and (2, 428,
0.78 s) after a warm-up gave a base of -1.0 s and 133 ms per sequence, predicting 0 ms for the
62 ms decode steps that followed and 10 s for a 1.3 s prompt step, and the replica refused
every request of a burst. Each part here is a quantity the steps measure directly.

Why it errs towards admitting: a slope is only what the steps' spread of batch sizes shows (a
replica that has only seen one batch size predicts that step time for every batch), a part not
measured yet counts as zero, and nothing is ever negative (more work is never faster).

Forgetting is by time: a step's weight halves with every HALF_LIFE_S of steps run after it, so
the model follows the host's load (a CPU shared with the gateway in a burst) within a minute,
whatever the step rate; both parts forget on the same clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HALF_LIFE_S = 30.0  # of step time: long enough to span the batch sizes a burst goes through
# The ridge, as a variance added to the decode steps' sequence counts: far below any real spread
# of batch sizes (1 to 4 has 1.25), so it shrinks a measured slope by well under 1%, and keeps
# the line defined when every decode step had the same batch.
MIN_SEQS_VARIANCE = 0.01


@dataclass(frozen=True, slots=True)
class StepFit:
    base_s: float
    per_seq_s: float
    per_prompt_token_s: float

    def decode_step_s(self, num_seqs: float) -> float:
        return self.base_s + self.per_seq_s * num_seqs

    def step_s(self, num_seqs: float, num_tokens: float) -> float:
        return self.decode_step_s(num_seqs) + self.per_prompt_token_s * max(0.0, num_tokens - num_seqs)


class StepTimeModel:
    def __init__(self) -> None:
        # Decode steps, weighted sums: weight, and of s (sequences), y (seconds), s^2, s*y.
        self._w = self._s = self._y = self._ss = self._sy = 0.0
        # Prompt steps, weighted sums: of their time beyond the decode line, and of prompt tokens.
        self._prompt_s = self._prompt_tokens = 0.0
        self._fit: StepFit | None = None

    @property
    def fit(self) -> StepFit | None:
        """None before the first step."""
        return self._fit

    def step_s(self, num_seqs: float, num_tokens: float) -> float | None:
        return None if self._fit is None else self._fit.step_s(num_seqs, num_tokens)

    def add(self, duration_s: float, num_seqs: int, num_tokens: int) -> None:
        self._decay(math.exp(-math.log(2) * duration_s / HALF_LIFE_S))
        num_prompt_tokens = num_tokens - num_seqs
        if num_prompt_tokens > 0:
            decode_s = self._fit.decode_step_s(num_seqs) if self._fit else 0.0
            self._prompt_s += max(0.0, duration_s - decode_s)
            self._prompt_tokens += num_prompt_tokens
        else:
            self._w += 1.0
            self._s += num_seqs
            self._y += duration_s
            self._ss += num_seqs * num_seqs
            self._sy += num_seqs * duration_s
        self._fit = self._solve()

    def _decay(self, factor: float) -> None:
        self._w *= factor
        self._s *= factor
        self._y *= factor
        self._ss *= factor
        self._sy *= factor
        self._prompt_s *= factor
        self._prompt_tokens *= factor

    def _solve(self) -> StepFit:
        base, per_seq = self._decode_line()
        per_prompt_token = self._prompt_s / self._prompt_tokens if self._prompt_tokens else 0.0
        return StepFit(base, per_seq, per_prompt_token)

    def _decode_line(self) -> tuple[float, float]:
        """(base, per sequence) of the decode steps; (0, 0) before any."""
        if not self._w:
            return 0.0, 0.0
        mean_s, mean_y = self._s / self._w, self._y / self._w
        var_s = self._ss / self._w - mean_s * mean_s + MIN_SEQS_VARIANCE
        per_seq = max(0.0, (self._sy / self._w - mean_s * mean_y) / var_s)
        base = mean_y - per_seq * mean_s
        if base < 0:  # through the origin instead: all of a step is then per sequence
            return 0.0, self._sy / self._ss
        return base, per_seq

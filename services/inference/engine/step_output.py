"""What one engine step launched, as the engine tells the scheduler (LaunchedBatch), and the
tokens it sampled, as the scheduler answers once they reach the host (SampledTokens). Pure Python.

SampledTokens are columns, not an object per token (issue 19): at 256 sequences the per-token
object and its construction were a third of the update phase, and the engine turns the columns
into its outputs' columns (llmserve.engine_output.TokenColumns) with a list comprehension each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.inference.engine.sequence import Sequence
from llmserve.sampling import FinishReason

if TYPE_CHECKING:
    from llmserve.inference.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class LaunchedBatch:
    """A batch queued on the device, and which sequence samples in each row."""

    batch: ScheduledBatch
    # Row i of the step's sampled tokens: the batch's sampling sequences, then forked siblings.
    sampling_seqs: list[Sequence]
    # (parent, child): siblings whose first token is sampled from their parent's logits row.
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)


@dataclass(slots=True)
class SampledTokens:
    """The tokens a launch sampled, now known on the host: `seqs[i]` got `token_ids[i]`, row
    `rows[i]` of the launch's sampled tokens (sequences finished before it are left out).
    `finishes` names the few that the token finished: (i, finish_reason, stop_token_id)."""

    seqs: list[Sequence]
    rows: list[int] | range
    token_ids: list[int]
    finishes: list[tuple[int, FinishReason, int | None]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

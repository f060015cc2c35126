"""What one engine step launched, as the engine tells the scheduler (LaunchedBatch), and the
tokens it sampled, as the scheduler answers once they reach the host (NewToken). Pure Python.
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


@dataclass(slots=True)  # not frozen: one is built per token, and a frozen init costs 2x
class NewToken:
    """A sampled token now known on the host (row `row` of its step's sampled tokens)."""

    seq: Sequence
    row: int
    token_id: int
    finish_reason: FinishReason | None
    stop_token_id: int | None

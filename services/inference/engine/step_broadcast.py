"""StepBroadcast: rank 0 hands each step it schedules to the other tensor-parallel ranks.

The scheduler, the block manager and the sampler run once, on rank 0 (engine/torch_engine.py);
the other ranks only run the forward (engine/rank_worker.py). For a step they need what rank
0's ModelRunner.execute reads: the block copies (copy-on-fork), the step's inputs (ids,
positions, slots, block tables: every rank's KV pool is addressed by the same block table),
and, with async scheduling, the token ids sampled by the step in flight that fill this step's
placeholder rows. Those ids exist only on rank 0's device: they follow the message as a device
broadcast, stream-ordered, so rank 0 does not wait for its sampling to finish (NCCL; gloo on
CPU is synchronous anyway).

The message is pickled into the ranks' shared-memory ring (models/rank_ring.py): rank 0 goes on
once it is written, without waiting for the other ranks to take it. A message of None ends the
other ranks' loop.

Decode block tables go as changes: most of a decode step's bytes are its block tables (256
sequences at 1k-token contexts: ~16k block ids, ~55 KB pickled), and a sequence's table changes
once every block_size tokens. A sequence's block_ids list is replaced, never changed in place
(the persistent decode batch, decode_batch.py, relies on the same), so rank 0 sends None for a
row whose list is the one it sent for that sequence at the step before, and each rank puts back
the list it received then. Both sides keep only the sequences of the latest step, so a sequence
that skips a step is sent whole when it comes back. The decode graphs' device rows need none of
the lists: the step carries the batch's rows and the table entries it changed
(StepInputs.decode_rows, decode_table_changes), which every rank writes into its own rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmserve.inference.models.rank_group import RankGroup
from llmserve.inference.models.step_inputs import StepInputs


@dataclass(slots=True)
class StepMessage:
    block_copies: list[tuple[int, int]]
    inputs: StepInputs
    # The in-flight step's sampled ids follow when this step reads them: their count and dtype.
    num_launched_tokens: int = 0
    launched_dtype: torch.dtype = torch.int64


@dataclass(slots=True)
class ReceivedStep:
    block_copies: list[tuple[int, int]]
    inputs: StepInputs
    launched_tokens: torch.Tensor | None  # on this rank's device


class StepBroadcast:
    def __init__(self, group: RankGroup, device: torch.device):
        self._group = group
        self._device = device
        # The decode block tables of the latest step, by sequence id: sent (rank 0) or received.
        self._tables: dict[int, list[int]] = {}

    def send(self, block_copies: list[tuple[int, int]], step: StepInputs, launched_tokens: torch.Tensor | None) -> None:
        """Rank 0: this step, before it runs its own forward."""
        reads_launched = len(step.placeholder_rows) > 0 and launched_tokens is not None
        message = StepMessage(block_copies, self._with_table_changes(step))
        if reads_launched:
            message.num_launched_tokens, message.launched_dtype = launched_tokens.numel(), launched_tokens.dtype
        self._group.send_to_ranks(message)
        if reads_launched:
            self._group.broadcast_tensor(launched_tokens.contiguous())

    def stop(self) -> None:
        """Rank 0: no step follows."""
        self._group.send_to_ranks(None)

    def receive(self) -> ReceivedStep | None:
        """The other ranks: the next step (blocks until rank 0 sends it), or None: stop."""
        message: StepMessage | None = self._group.receive_from_leader()
        if message is None:
            return None
        self._restore_tables(message.inputs)
        launched = None
        if message.num_launched_tokens:
            launched = torch.empty(message.num_launched_tokens, dtype=message.launched_dtype, device=self._device)
            self._group.broadcast_tensor(launched)
        return ReceivedStep(message.block_copies, message.inputs, launched)

    def _with_table_changes(self, step: StepInputs) -> StepInputs:
        """`step` with None for each decode table that is the list sent for its sequence last step."""
        seq_ids, tables = step.decode_seq_ids, step.decode_block_tables
        if len(seq_ids) != len(tables):  # rows without ids (a hand-built step): every table whole
            self._tables = {}
            return step
        sent = self._tables
        changes = [None if sent.get(seq_id) is table else table for seq_id, table in zip(seq_ids, tables)]
        self._tables = dict(zip(seq_ids, tables))
        return dataclasses.replace(step, decode_block_tables=changes)

    def _restore_tables(self, step: StepInputs) -> None:
        """Put back, in place, the lists rank 0 left out as unchanged."""
        seq_ids, changes = step.decode_seq_ids, step.decode_block_tables
        if len(seq_ids) != len(changes):
            self._tables = {}
            return
        known = self._tables
        step.decode_block_tables = [known[seq_id] if table is None else table for seq_id, table in zip(seq_ids, changes)]
        self._tables = dict(zip(seq_ids, step.decode_block_tables))

"""BlockTableRows: the block tables of decoding sequences kept on the device across steps, each
sequence in a row of its own, rewritten only when its table changed.

A decode step of 256 sequences with contexts of ~1k tokens has ~16k block ids; converting them
from Python lists into the graph's static table every step cost about as much host time as the
rest of the step's inputs together (issue 19). A sequence's table changes once every
block_size tokens (a new block appended), when the prefix cache swaps a block for its
registered twin, or when it is recomputed after a preemption; in between it is the same list.
So each sequence keeps a row of a device table, a step sends only the rows that changed and the
row of each of its sequences, and the graph gathers its block tables from the rows on the
device (DecodeGraphs).

Rows are assigned on first sight, by sequence id, and the table each step brings is compared
with what was written by identity: a sequence's block_ids list is replaced, never changed in
place (Sequence's docstring), and a step passes that list itself, so the same object is the
same table and a changed table is a new object (a slice, or a new block_ids list). A row can
never be stale; a new object with the old contents only costs a re-upload. (Before: a list
comparison per sequence per step, ~0.15 µs each at ~50 blocks; issue 19.) Row 0 stays all zeros for padding
rows. There are twice as many rows as a step can hold, plus one: when none is free, every row
of a sequence not in the current step is taken back, which frees at least half.
"""

from __future__ import annotations

import torch


PADDING_ROW = 0


class BlockTableRows:
    def __init__(self, max_seqs_per_step: int, width: int, device: torch.device):
        self.num_rows = 2 * max_seqs_per_step + 1
        self.table = torch.zeros(self.num_rows, width, dtype=torch.int32, device=device)
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._written: list[list[int] | None] = [None] * self.num_rows
        self._free = list(range(self.num_rows - 1, PADDING_ROW, -1))

    def assign(self, seq_ids: list[int], tables: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """(row of each sequence, (row, first column) of each row whose table changed: the
        entries `written(row)[first:]` must be uploaded). A table that extends what its row
        holds (a block appended, the usual change) sends only the new entries; any other
        change, the whole table. The tables are kept as given: the caller passes lists nobody
        changes in place."""
        rows, changed = [], []
        row_of, written = self._row_of, self._written
        for seq_id, table in zip(seq_ids, tables):
            row = row_of.get(seq_id)
            if row is None:
                row = self._take_row(seq_ids)
                row_of[seq_id] = row
            old = written[row]
            if old is not table:
                extends = old is not None and len(table) > len(old) and table[: len(old)] == old
                written[row] = table
                changed.append((row, len(old) if extends else 0))
            rows.append(row)
        return rows, changed

    def written(self, row: int) -> list[int]:
        """The block ids `row` holds after the latest assign (its first len() entries)."""
        return self._written[row]

    def _take_row(self, step_seq_ids: list[int]) -> int:
        if not self._free:
            self._reclaim(set(step_seq_ids))
        return self._free.pop()

    def _reclaim(self, keep: set[int]) -> None:
        for seq_id in [seq_id for seq_id in self._row_of if seq_id not in keep]:
            row = self._row_of.pop(seq_id)
            self._written[row] = None
            self._free.append(row)

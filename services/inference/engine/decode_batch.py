"""DecodeBatch: the engine's persistent batch of decoding sequences. Each sequence keeps a row
across steps, its block table is mirrored in that row on the host (and, through the changes a
step carries, on the device: engine/cuda_graphs.py), and a step's decode inputs are built from
the rows with array operations instead of a loop over the sequences (issue 19).

A decode step of 256 sequences at ~1k-token contexts has ~16k block ids, and a sequence's table
changes once every block_size tokens (a block appended), when the prefix cache swaps a block
for its registered twin, or when it is recomputed after a preemption. So per step only a few
values per sequence are read from its Sequence (its row, table, position and placeholder, one
list comprehension each) and the rest is numpy over the rows: each token's cache slot is
gathered from the mirrored tables, context lengths and input ids follow from the positions.
Only the rows whose table changed are written, and the step lists what it wrote as (row,
column, block id) entries for the device's copy of the rows.

A table is compared with what its row holds by identity: a sequence's block_ids list is
replaced, never changed in place (Sequence's docstring), so the same object is the same table
and a changed table is a new object; a new object with the old contents costs one re-upload. A
table that extends what its row holds (a block appended, the usual change) writes only the new
entries. Row 0 (PADDING_ROW) stays all zeros for the decode graphs' padding rows. There are
twice as many rows as a step can hold, plus one: when none is free, every row of a sequence not
in the current step is taken back, which frees at least half.

Sequence.decode_row is the sequence's row (-1: none); only this class writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import is_not

import numpy as np

from llmserve.inference.engine.sequence import Sequence

PADDING_ROW = 0
_NONE = np.zeros(0, dtype=np.int64)  # no rows (never written to)


def decode_row_count(max_seqs_per_step: int) -> int:
    """Rows of a batch whose steps hold at most `max_seqs_per_step` decodes (the device copy
    of the tables has as many)."""
    return 2 * max_seqs_per_step + 1


@dataclass(slots=True)
class DecodeInputs:
    """One step's decode rows as arrays, in the order of the sequences given (StepInputs' decode
    fields: models/step_inputs.py)."""

    rows: np.ndarray  # int32 [n]: each sequence's row
    input_ids: np.ndarray  # int64 [n]: 0 where the input is a placeholder
    positions: np.ndarray  # int64 [n]
    slot_mapping: np.ndarray  # int64 [n]
    context_lens: np.ndarray  # int64 [n]: the new token included
    placeholder_rows: np.ndarray  # int64: which of the n rows read their input from the step in flight
    placeholder_source_rows: np.ndarray  # int64: from which row of its sampled tokens
    table_changes: np.ndarray | None  # int32 [3, k]: (row, column, block id) written; None: none
    block_tables: list[list[int]]  # each sequence's block_ids list itself


class DecodeBatch:
    def __init__(self, max_seqs_per_step: int, width: int, block_size: int):
        """`width`: the most blocks a sequence's table may hold (the longest context)."""
        self.max_seqs_per_step = max_seqs_per_step
        self.num_rows = decode_row_count(max_seqs_per_step)
        self.width = width
        self.block_size = block_size
        self.tables = np.zeros((self.num_rows, width), dtype=np.int64)  # the host mirror
        self._written: list[list[int] | None] = [None] * self.num_rows  # the table each row holds
        self._seq_of_row: list[Sequence | None] = [None] * self.num_rows
        self._free = list(range(self.num_rows - 1, PADDING_ROW, -1))

    def build(self, seqs: list[Sequence]) -> DecodeInputs:
        """The decode inputs of `seqs`, each computing one token (its next uncomputed one);
        rows assigned and tables written first."""
        if len(seqs) > self.max_seqs_per_step:
            raise ValueError(f"{len(seqs)} decodes in a step of a batch of at most {self.max_seqs_per_step}")
        row_list = [seq.decode_row for seq in seqs]
        if -1 in row_list:
            self._assign_rows(seqs, row_list)
        tables = [seq.block_ids for seq in seqs]
        written = self._written
        changed = list(compress(range(len(seqs)), map(is_not, tables, [written[row] for row in row_list])))
        table_changes = self._write_tables([row_list[i] for i in changed], [tables[i] for i in changed])
        rows = np.array(row_list, dtype=np.int32)
        position_list = [seq.num_computed_tokens for seq in seqs]
        positions = np.array(position_list, dtype=np.int64)
        block_size = self.block_size
        slot_mapping = self.tables[rows, positions // block_size] * block_size + positions % block_size
        input_ids, placeholder_rows, source_rows = self._input_ids(seqs, position_list)
        return DecodeInputs(rows, input_ids, positions, slot_mapping, positions + 1, placeholder_rows, source_rows,
                            table_changes, tables)

    def written(self, row: int) -> list[int] | None:
        """The block table `row` holds (its first len() entries of the mirror)."""
        return self._written[row]

    def _input_ids(self, seqs: list[Sequence], positions: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, placeholder rows, their source rows). A scheduled sequence with a
        placeholder computes that token and no other (Sequence's invariants: it is its only
        uncomputed token), so its row's input is the placeholder."""
        source_list = [seq.placeholder_row for seq in seqs]
        if min(source_list) >= 0:  # async scheduling's steady state
            return np.zeros(len(seqs), dtype=np.int64), np.arange(len(seqs)), np.array(source_list, dtype=np.int64)
        if max(source_list) < 0:  # without async scheduling: every input is known
            return np.array([seq.token_ids[p] for seq, p in zip(seqs, positions)], dtype=np.int64), _NONE, _NONE
        sources = np.array(source_list, dtype=np.int64)
        is_placeholder = sources >= 0
        input_ids = np.zeros(len(seqs), dtype=np.int64)
        known = np.flatnonzero(~is_placeholder).tolist()
        input_ids[known] = [seqs[i].token_ids[positions[i]] for i in known]
        placeholder_rows = np.flatnonzero(is_placeholder)
        return input_ids, placeholder_rows, sources[placeholder_rows]

    def _assign_rows(self, seqs: list[Sequence], row_list: list[int]) -> None:
        """A row for each sequence without one (row_list updated in place)."""
        for i, seq in enumerate(seqs):
            if seq.decode_row < 0:
                if not self._free:
                    self._reclaim(seqs)
                row = self._free.pop()
                seq.decode_row = row
                self._seq_of_row[row] = seq
                row_list[i] = row

    def _reclaim(self, step_seqs: list[Sequence]) -> None:
        keep = set(step_seqs)
        for row, seq in enumerate(self._seq_of_row):
            if seq is not None and seq not in keep:
                seq.decode_row = -1
                self._seq_of_row[row] = None
                self._written[row] = None
                self._free.append(row)

    def _write_tables(self, rows: list[int], tables: list[list[int]]) -> np.ndarray | None:
        """Mirror each table in its row; the (row, column, block id) entries written."""
        if not rows:
            return None
        row_ids: list[int] = []
        column_ids: list[int] = []
        block_ids: list[int] = []
        written = self._written
        for row, table in zip(rows, tables):
            if len(table) > self.width:
                raise ValueError(f"a block table of {len(table)} blocks is wider than the batch's {self.width}")
            old = written[row]
            extends = old is not None and len(table) > len(old) and table[: len(old)] == old
            first = len(old) if extends else 0
            written[row] = table
            row_ids += [row] * (len(table) - first)
            column_ids += range(first, len(table))
            block_ids += table[first:] if first else table
        changes = np.array([row_ids, column_ids, block_ids], dtype=np.int32).reshape(3, -1)
        self.tables[changes[0], changes[1]] = changes[2]
        return changes

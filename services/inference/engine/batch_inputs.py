"""ScheduledBatch -> StepInputs (models/step_inputs.py): one step's flat model inputs, built on
the host. Pure Python. The layout is StepInputs' docstring.

Decodes (one token each) take a loop of their own: at 256 running sequences they are nearly
every row of nearly every step, so their per-sequence work is kept to a few list appends, and
a decode's block table is its block_ids list itself, not a copy (issue 19: the copy was ~0.4 µs
per sequence at ~50 blocks, and the decode graphs then compared it with the row they hold; see
engine/block_table_rows.py).
"""

from __future__ import annotations

from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.models.step_inputs import StepInputs


def build_step_inputs(batch: ScheduledBatch, block_size: int, sampling_indexes: list[int] | None = None) -> StepInputs:
    """`sampling_indexes`: batch.sampling_indexes(), when the caller has it already."""
    step = StepInputs()
    decode_indexes = [i for i, num_new in enumerate(batch.num_new_tokens) if num_new == 1]
    _add_decodes(step, batch, decode_indexes, block_size)
    if sampling_indexes is None:
        sampling_indexes = batch.sampling_indexes()
    if len(decode_indexes) == len(batch.seqs):  # one token each: the flat row of batch index i is i
        step.logits_indices = list(sampling_indexes)
        return step
    last_rows = dict(zip(decode_indexes, range(len(decode_indexes))))  # batch index -> flat row of its last token
    _add_prefills(step, batch, block_size, last_rows)
    step.logits_indices = [last_rows[i] for i in sampling_indexes]
    return step


def _add_decodes(step: StepInputs, batch: ScheduledBatch, indexes: list[int], block_size: int) -> None:
    input_ids, positions, slot_mapping = step.input_ids, step.positions, step.slot_mapping
    tables, context_lens, seq_ids = step.decode_block_tables, step.decode_context_lens, step.decode_seq_ids
    seqs = batch.seqs
    for row, i in enumerate(indexes):
        seq = seqs[i]
        position = seq.num_computed_tokens
        block_ids = seq.block_ids
        block_index = position // block_size
        if seq.placeholder_row >= 0 and position == len(seq.token_ids) - 1:  # Sequence.has_placeholder
            input_ids.append(0)
            step.placeholder_rows.append(row)
            step.placeholder_source_rows.append(seq.placeholder_row)
        else:
            input_ids.append(seq.token_ids[position])
        positions.append(position)
        slot_mapping.append(block_ids[block_index] * block_size + position % block_size)
        # The list itself when it ends at this block (the usual case: no copy; it is never
        # changed in place, Sequence's docstring), else the part up to it.
        tables.append(block_ids if len(block_ids) == block_index + 1 else block_ids[: block_index + 1])
        context_lens.append(position + 1)
        seq_ids.append(seq.seq_id)


def _add_prefills(step: StepInputs, batch: ScheduledBatch, block_size: int, last_rows: dict[int, int]) -> None:
    for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if num_new == 1:
            continue
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        block_ids = seq.block_ids
        query_start = len(step.input_ids)
        step.input_ids.extend(seq.token_ids[start:end])
        if end == seq.num_tokens and seq.has_placeholder:
            step.input_ids[-1] = 0
            step.placeholder_rows.append(len(step.input_ids) - 1)
            step.placeholder_source_rows.append(seq.placeholder_row)
        step.positions.extend(range(start, end))
        step.slot_mapping.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
        last_rows[i] = query_start + num_new - 1
        step.prefill_query_starts.append(query_start)
        step.prefill_query_lens.append(num_new)
        step.prefill_context_lens.append(end)
        step.prefill_block_tables.append(block_ids[: -(-end // block_size)])
        step.prefill_has_cached_prefix.append(start > 0)

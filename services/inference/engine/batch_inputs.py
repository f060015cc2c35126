"""ScheduledBatch -> StepInputs (models/step_inputs.py): one step's flat model inputs, built on
the host. The layout is StepInputs' docstring.

Decodes (one token each) come from the engine's persistent batch (engine/decode_batch.py): at
256 running sequences they are nearly every row of nearly every step, so they are built as
arrays over the batch's rows, not by a loop over the sequences (issue 19). A decode-only step
keeps them as arrays; a step with prefill chunks, rare once streams are running and dominated
by its prefill, continues them as lists with the chunks' rows.
"""

from __future__ import annotations

from llmserve.inference.engine.decode_batch import DecodeBatch
from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.models.step_inputs import StepInputs


def build_step_inputs(
    batch: ScheduledBatch, decodes: DecodeBatch, sampling_indexes: list[int] | None = None
) -> StepInputs:
    """`decodes`: the engine's persistent batch (its block size is the cache's);
    `sampling_indexes`: batch.sampling_indexes(), when the caller has it already."""
    decode_indexes = batch.one_token_indexes()
    step = StepInputs()
    if decode_indexes:
        _add_decodes(step, batch, decode_indexes, decodes)
    if sampling_indexes is None:
        sampling_indexes = batch.sampling_indexes()
    if len(decode_indexes) == len(batch.seqs):  # one token each: the flat row of batch index i is i
        step.logits_indices = list(sampling_indexes)
        return step
    _as_lists(step)
    last_rows = dict(zip(decode_indexes, range(len(decode_indexes))))  # batch index -> flat row of its last token
    _add_prefills(step, batch, decodes.block_size, last_rows)
    step.logits_indices = [last_rows[i] for i in sampling_indexes]
    return step


def _add_decodes(step: StepInputs, batch: ScheduledBatch, indexes: list[int], decodes: DecodeBatch) -> None:
    seqs = batch.seqs if len(indexes) == len(batch.seqs) else [batch.seqs[i] for i in indexes]
    rows = decodes.build(seqs)
    step.input_ids, step.positions, step.slot_mapping = rows.input_ids, rows.positions, rows.slot_mapping
    step.decode_context_lens = rows.context_lens
    step.placeholder_rows, step.placeholder_source_rows = rows.placeholder_rows, rows.placeholder_source_rows
    step.decode_rows, step.decode_table_changes = rows.rows, rows.table_changes
    # The lists themselves (never changed in place): the portable attention backend and the
    # tensor-parallel broadcast read them.
    step.decode_block_tables = rows.block_tables
    step.decode_seq_ids = [seq.seq_id for seq in seqs]


def _as_lists(step: StepInputs) -> None:
    """The decode rows' arrays as lists, for the prefill chunks' rows to follow."""
    for name in ("input_ids", "positions", "slot_mapping", "decode_context_lens", "placeholder_rows",
                 "placeholder_source_rows"):
        values = getattr(step, name)
        if not isinstance(values, list):
            setattr(step, name, values.tolist())


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

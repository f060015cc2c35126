"""ScheduledBatch -> StepInputs (models/step_inputs.py): one step's flat model inputs, built on
the host. Pure Python. The layout is StepInputs' docstring."""

from __future__ import annotations

from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.models.step_inputs import StepInputs


def build_step_inputs(batch: ScheduledBatch, block_size: int) -> StepInputs:
    step = StepInputs()
    order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] > 1)  # decodes first
    last_rows: dict[int, int] = {}  # batch index -> flat row of its last token
    for i in order:
        seq, num_new = batch.seqs[i], batch.num_new_tokens[i]
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        block_ids = seq.block_ids
        table = block_ids[: -(-end // block_size)]
        query_start = len(step.input_ids)
        step.input_ids.extend(seq.token_ids[start:end])
        if end == seq.num_tokens and seq.has_placeholder:
            step.input_ids[-1] = 0
            step.placeholder_rows.append(len(step.input_ids) - 1)
            step.placeholder_source_rows.append(seq.placeholder_row)
        step.positions.extend(range(start, end))
        step.slot_mapping.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
        last_rows[i] = query_start + num_new - 1
        if num_new == 1:
            step.decode_block_tables.append(table)
            step.decode_context_lens.append(end)
        else:
            step.prefill_query_starts.append(query_start)
            step.prefill_query_lens.append(num_new)
            step.prefill_context_lens.append(end)
            step.prefill_block_tables.append(table)
            step.prefill_has_cached_prefix.append(start > 0)
    step.logits_indices = [last_rows[i] for i in range(len(batch.seqs)) if batch.samples(i)]
    return step

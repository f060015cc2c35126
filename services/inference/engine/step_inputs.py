"""One step's flat model inputs, built on the host from a ScheduledBatch. Pure Python.

Order: the single-token sequences (decodes) first, then the multi-token prefill chunks, each
contiguous, so attention can treat the leading rows as one decode batch. Per token: its id,
position and cache slot (slot = block_id * block_size + offset). Per decode: the block table
up to its context and the context length (new token included). Per prefill chunk: its first
row, length, context length (cached prefix + chunk) and block table; `has_cached_prefix` tells
the portable attention backend whether the chunk's context is just the chunk. `logits_indices`
are the rows whose logits are sampled: the last token of each sequence that samples, in batch
order.

Async scheduling: a sequence's last input token may still be pending (sampled by the step in
flight, not yet on the host). Its row gets id 0 here and is listed in `pending_rows`, with the
row of the in-flight step's sampled tokens to read it from on the device in
`pending_source_rows` (ModelRunner fills them before the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.inference.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    decode_block_tables: list[list[int]] = field(default_factory=list)
    decode_context_lens: list[int] = field(default_factory=list)
    prefill_query_starts: list[int] = field(default_factory=list)
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_context_lens: list[int] = field(default_factory=list)
    prefill_block_tables: list[list[int]] = field(default_factory=list)
    prefill_has_cached_prefix: list[bool] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)
    pending_source_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_lens)

    @property
    def is_decode_only(self) -> bool:
        return not self.prefill_query_lens


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
        if end == seq.num_tokens and seq.has_pending_token:
            step.input_ids[-1] = 0
            step.pending_rows.append(len(step.input_ids) - 1)
            step.pending_source_rows.append(seq.pending_token_row)
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


def pad_rows(rows: list[list[int]], width: int, num_rows: int | None = None, fill: int = 0) -> list[list[int]]:
    """`rows` right-padded to `width`, plus all-`fill` rows up to `num_rows`."""
    padded = [row + [fill] * (width - len(row)) for row in rows]
    if num_rows is not None:
        padded.extend([fill] * width for _ in range(num_rows - len(rows)))
    return padded

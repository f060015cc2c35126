"""StepInputs: one step's flat model inputs, as the model's attention reads them.

Order: the single-token sequences (decodes) first, then the multi-token prefill chunks, each
contiguous, so attention can treat the leading rows as one decode batch. Per token: its id,
position and cache slot (slot = block_id * block_size + offset). Per decode: the block table
up to its context and the context length (new token included). Per prefill chunk: its first
row, length, context length (cached prefix + chunk) and block table; `has_cached_prefix` tells
the portable attention backend whether the chunk's context is just the chunk. `logits_indices`
are the rows whose logits are sampled: the last token of each sequence that samples, in batch
order.

Async scheduling: a sequence's last input token may still be in flight (sampled by the step
on the device, not yet on the host). Its row gets id 0 and is listed in `placeholder_rows`, with
the row of the in-flight step's sampled tokens to read it from on the device in
`placeholder_source_rows` (ModelRunner fills them before the forward).

Decodes and the persistent batch (engine/decode_batch.py): each decode also has its row in the
engine's batch of decoding sequences (`decode_rows`), and the step lists the (row, column, block
id) entries of the rows' tables it changed (`decode_table_changes`, [3, k]); the decode graphs
keep those rows on the device and gather the step's tables from them. A decode-only step the
engine builds holds its per-row fields as numpy arrays (Ints), any other step as lists; a step
built by hand may leave the rows out (None), and then runs without the decode graphs.

The engine builds them (engine/batch_inputs.py); the models only read them, so this type
lives below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Ints = list[int] | np.ndarray  # one int per row


@dataclass(slots=True)
class StepInputs:
    input_ids: Ints = field(default_factory=list)
    positions: Ints = field(default_factory=list)
    slot_mapping: Ints = field(default_factory=list)
    decode_block_tables: list[list[int]] = field(default_factory=list)
    decode_context_lens: Ints = field(default_factory=list)
    decode_seq_ids: list[int] = field(default_factory=list)  # whose table each is (kept across steps by id)
    decode_rows: np.ndarray | None = None  # int32 [num_decodes]: each decode's row of the persistent batch
    decode_table_changes: np.ndarray | None = None  # int32 [3, k]: (row, column, block id); None: none
    prefill_query_starts: list[int] = field(default_factory=list)
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_context_lens: list[int] = field(default_factory=list)
    prefill_block_tables: list[list[int]] = field(default_factory=list)
    prefill_has_cached_prefix: list[bool] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    placeholder_rows: Ints = field(default_factory=list)
    placeholder_source_rows: Ints = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_lens)

    @property
    def is_decode_only(self) -> bool:
        return not self.prefill_query_lens


def pad_rows(rows: list[list[int]], width: int, num_rows: int | None = None, fill: int = 0) -> list[list[int]]:
    """`rows` right-padded to `width`, plus all-`fill` rows up to `num_rows`."""
    padded = [row + [fill] * (width - len(row)) for row in rows]
    if num_rows is not None:
        padded.extend([fill] * width for _ in range(num_rows - len(rows)))
    return padded

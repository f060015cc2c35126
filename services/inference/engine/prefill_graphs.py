"""CUDA graphs for small prefill steps: one graph per padded token count, replayed over static
buffers.

Why: a prefill step of a few hundred tokens over a cached prefix (a prefix-cache hit, the tail
of a chunked prompt) is host-bound: ~250 kernel launches through Python take ~12 ms on an
H200 for ~6.6 ms of GPU work (Qwen2.5-1.5B shape, 416 new tokens over 3680 cached, issue 10).
Replayed as one graph, the launches cost nothing on the host.

A step fits when it is one prefill chunk, no decodes, of at most the largest size: it replays
the graph of the smallest size P >= its token count. Its rows are the chunk's, then P - n
padding rows (token 0, position 0, slot PADDING_SLOT so nothing is written to the cache); the
graph computes logits only for the row the static logits index names (the chunk's last row).
Padding rows' attention outputs are left unwritten by the kernel: every op after attention is
row-wise, so their garbage never reaches a real row. Any cached-context length up to
max_context_tokens fits: the paged prefill kernel reads query length, context length and the
block table from the static device buffers, and its fixed grid over P rows leaves tiles past
the chunk's end idle. Other steps (several chunks, decodes mixed in, more tokens) run eagerly.

Sizes (PREFILL_GRAPH_TOKEN_SIZES, cut at max_batched_tokens): a prefill step stops being
host-bound near ~1k tokens on the 1.5B shape (its GPU time reaches the ~12 ms the launches
take), so the largest graph is 1024 tokens. Between 64 and 512 the sizes step by 64, the
prefill kernel's query tile, so padding adds at most one idle tile and under 64 rows to the
GEMMs (416 new tokens -> 448: +8%, where 512 would add 23%); above 512, by 128. Fourteen
graphs: each capture is one warm-up forward and one captured forward (the start-up log gives
the total). They share the decode graphs' memory pool and are captured largest first, so their
activations (at most the 1024-token graph's, ~60 MB of MLP intermediates on the 1.5B shape)
reuse the same blocks; each keeps only its one row of logits.

Not covered: one chunk plus decode rows (common under load). The decode rows would need a
decode part of fixed size in every prefill graph (a graph per (decode size, token size) pair),
or run through the prefill kernel as one-token chunks of a fixed number of chunk slots (a
64-row tile for one query, no GQA sharing of K/V loads: fine for a few decodes, far slower than
the decode kernel for the tens to hundreds a loaded step has); so those steps replay the model's
pieces between attention calls (engine/piecewise_graphs.py), or run eagerly with
--no-piecewise-graphs.

`PrefillGraphs(pool=None)` runs the same static-buffer path uncaptured (CPU tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from llmserve.inference.engine.cuda_graphs import GraphPool, GraphSet, graph_batch_sizes, graph_size_for
from llmserve.inference.engine.static_inputs import StaticInputs
from llmserve.inference.models.step_inputs import StepInputs
from llmserve.inference.models.attention_backend import PADDING_SLOT

PREFILL_GRAPH_TOKEN_SIZES = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)

# (input_ids, positions, attention metadata, rows [k] int32) -> float32 logits [k, vocab] of `rows`
ForwardRows = Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], torch.Tensor]
# (slot_mapping [P], block_tables [1, max_blocks], query_starts, query_lens, context_lens [1]) -> metadata
PrefillMetadataFor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], object]


def prefill_graph_sizes(max_batched_tokens: int, sizes: tuple[int, ...] = PREFILL_GRAPH_TOKEN_SIZES) -> tuple[int, ...]:
    """The sizes below the step budget, then the budget itself, up to the largest size."""
    return graph_batch_sizes(min(max_batched_tokens, sizes[-1]), sizes)


def is_single_chunk(step: StepInputs) -> bool:
    return step.num_decodes == 0 and len(step.prefill_query_lens) == 1


@dataclass(slots=True)
class PaddedPrefill:
    """A single-chunk step's inputs padded to a graph size: the StaticInputs fields."""

    input_ids: list[int]  # [size]
    positions: list[int]  # [size]
    slot_mapping: list[int]  # [size]
    block_table: list[int]  # the chunk's blocks up to its context
    query_len: list[int]  # [1]
    context_len: list[int]  # [1]
    logits_index: list[int]  # [1]: the chunk's last row (read only when the step samples)


def pad_prefill_step(step: StepInputs, size: int) -> PaddedPrefill:
    num_pad = size - step.num_tokens
    assert is_single_chunk(step) and num_pad >= 0
    return PaddedPrefill(
        input_ids=step.input_ids + [0] * num_pad,
        positions=step.positions + [0] * num_pad,
        slot_mapping=step.slot_mapping + [PADDING_SLOT] * num_pad,
        block_table=step.prefill_block_tables[0],
        query_len=[step.num_tokens],
        context_len=step.prefill_context_lens,
        logits_index=[step.num_tokens - 1],
    )


class PrefillGraphs(GraphSet):
    """Static single-chunk prefill inputs, and one graph per padded token count."""

    def __init__(self, forward_rows: ForwardRows, sizes: tuple[int, ...], max_blocks_per_seq: int,
                 metadata_for: PrefillMetadataFor, device: torch.device, pool: GraphPool | None):
        super().__init__(sizes, max_blocks_per_seq, metadata_for)
        self.forward_rows = forward_rows
        max_size = self.sizes[-1]
        self.inputs = StaticInputs(
            {"input_ids": max_size, "positions": max_size, "slot_mapping": max_size, "block_table": max_blocks_per_seq,
             "query_start": 1, "query_len": 1, "context_len": 1, "logits_index": 1},
            device,
        )  # fmt: skip
        # What the warm-up forward of every size reads: one token, block 0, nothing written.
        self.inputs.stage({"slot_mapping": [PADDING_SLOT] * max_size, "query_len": [1], "context_len": [1]})
        self._capture("prefill", pool, device)

    def can_run(self, step: StepInputs) -> bool:
        return (
            is_single_chunk(step)
            and step.num_tokens <= self.sizes[-1]
            and len(step.prefill_block_tables[0]) <= self.max_blocks_per_seq
        )

    def run(self, step: StepInputs, fill_input_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """float32 logits [num_sampling (0 or 1), vocab] (a view of the graph's output: read it
        before the next step). `fill_input_ids` completes the staged ids on the device (placeholder
        tokens) before the replay."""
        size = graph_size_for(step.num_tokens, self.sizes)
        padded = pad_prefill_step(step, size)
        self.inputs.stage({field.name: getattr(padded, field.name) for field in fields(padded)})
        if fill_input_ids is not None:
            fill_input_ids(self.inputs.fields["input_ids"])
        return self._run(size, len(step.logits_indices))

    def _forward(self, size: int) -> torch.Tensor:
        static = self.inputs.fields
        meta = self.metadata_for(
            static["slot_mapping"][:size], static["block_table"].view(1, -1), static["query_start"],
            static["query_len"], static["context_len"],
        )
        return self.forward_rows(static["input_ids"][:size], static["positions"][:size], meta, static["logits_index"])

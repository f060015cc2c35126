"""CUDA graphs for decode steps: one graph per decode batch size, replayed over static buffers.

A decode-only step (every sequence computes one token) of n sequences replays the graph of the
smallest captured size b >= n (sizes: llmserve.buckets.DECODE_GRAPH_BATCH_SIZES up to
max_num_seqs, plus max_num_seqs). Its inputs are copied into static device buffers whose first
b rows the graph reads: the n real rows, then b - n padding rows (token 0, position 0, slot -1
so nothing is written to the cache, context length 0 so attention reads nothing). Block tables
stay on the device between steps, in the rows of the engine's persistent decode batch
(engine/decode_batch.py): a step uploads only the entries its batch changed
(StepInputs.decode_table_changes), and the graph's first op gathers the step's tables from the
rows. The graph
covers the whole forward and the lm_head; the step reads the logits of its real rows. The
attention metadata comes from the attention backend (AttentionBackend.decode_graph_metadata),
built over views of the static buffers: a replay reads each step's values through it.

Why: a decode step launches ~10 kernels per layer, most of them tiny at small batches; replayed
as one graph they run back to back without Python or launch gaps.

Graphs share one memory pool (with the prefill graphs too, engine/prefill_graphs.py) and are
captured largest first, so the smaller ones reuse its blocks (capture_graphs). Capture happens
at engine start, before the service reports SERVING. The host-side padding is pure
(pad_decode_step, the values `_stage` writes in place into its staging buffer);
`DecodeGraphs(pool=None)` runs the same static-buffer path eagerly, which is
how the CPU tests exercise it. GraphSet (graphs by size, replay or uncaptured run) and
capture_graphs are shared with the prefill graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from llmserve.buckets import DECODE_GRAPH_BATCH_SIZES
from llmserve.inference.engine.decode_batch import PADDING_ROW, decode_row_count
from llmserve.inference.models.step_inputs import StepInputs
from llmserve.inference.models.transfers import device_int32
from llmserve.inference.models.attention_backend import PADDING_SLOT

log = logging.getLogger(__name__)

# (input_ids, positions, attention metadata) -> float32 logits [num_rows, vocab]
ForwardLogits = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]
# (slot_mapping, block_tables, context_lens) over the static buffers -> attention metadata
DecodeMetadataFor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]
GraphPool = tuple  # torch.cuda.graph_pool_handle(): graphs captured into one pool share its memory


def graph_batch_sizes(max_num_seqs: int, sizes: tuple[int, ...] = DECODE_GRAPH_BATCH_SIZES) -> tuple[int, ...]:
    """The sizes below max_num_seqs, then max_num_seqs itself: every decode batch fits one."""
    return tuple(b for b in sizes if b < max_num_seqs) + (max_num_seqs,)


def graph_size_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= num_seqs (sizes ascending), or None when none is large enough."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass(slots=True)
class PaddedDecode:
    """A decode step's per-row inputs padded to a graph size (block tables travel as rows of
    the persistent decode batch, engine/decode_batch.py)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]


def pad_decode_step(step: StepInputs, size: int) -> PaddedDecode:
    num_pad = size - step.num_decodes
    assert step.is_decode_only and num_pad >= 0
    return PaddedDecode(
        input_ids=list(step.input_ids) + [0] * num_pad,
        positions=list(step.positions) + [0] * num_pad,
        slot_mapping=list(step.slot_mapping) + [PADDING_SLOT] * num_pad,
        context_lens=list(step.decode_context_lens) + [0] * num_pad,
    )


# A padding row's (input id, position, slot, context length, table row): pad_decode_step's values.
_PADDING_COLUMN = np.array([[0], [0], [PADDING_SLOT], [0], [PADDING_ROW]], dtype=np.int32)


class GraphSet:
    """One graph per size of `_forward(size)` over static inputs (the subclass's), captured into
    `pool`, or run uncaptured (pool=None: CPU tests, the same buffers and padding)."""

    def __init__(self, sizes: tuple[int, ...], max_blocks_per_seq: int, metadata_for: Callable[..., object]):
        self.sizes = tuple(sorted(sizes))
        self.max_blocks_per_seq = max_blocks_per_seq  # block-table width: the longest context a step may have
        self.metadata_for = metadata_for  # the attention backend's graph metadata over the static inputs
        self.num_steps = 0  # steps run on the static inputs (replays when captured)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def captured_graphs(self) -> Mapping[int, torch.cuda.CUDAGraph]:
        """The captured graphs by size (empty when uncaptured), read-only: what a benchmark
        replays alone, or a test checks a replay against."""
        return MappingProxyType(self._graphs)

    def forward_uncaptured(self, size: int) -> torch.Tensor:
        """The forward a graph of `size` captures, run eagerly over the static inputs as they
        are (a benchmark's eager step against the replay)."""
        return self._forward(size)

    def _forward(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def _capture(self, kind: str, pool: GraphPool | None, device: torch.device) -> None:
        if pool is not None:
            self._graphs, self._outputs = capture_graphs(kind, self.sizes, self._forward, pool, device)

    def _run(self, size: int, num_rows: int) -> torch.Tensor:
        """The first num_rows rows of the size's output, once the static inputs hold the step."""
        self.num_steps += 1
        graph = self._graphs.get(size)
        if graph is None:
            return self._forward(size)[:num_rows]
        graph.replay()
        return self._outputs[size][:num_rows]


class DecodeGraphs(GraphSet):
    """Static decode inputs, and one graph per decode batch size."""

    def __init__(
        self,
        forward_logits: ForwardLogits,
        sizes: tuple[int, ...],
        max_blocks_per_seq: int,
        metadata_for: DecodeMetadataFor,
        device: torch.device,
        pool: GraphPool | None,
    ):
        super().__init__(sizes, max_blocks_per_seq, metadata_for)
        self.forward_logits = forward_logits
        self.device = device
        max_size = self.sizes[-1]
        # Static device inputs; a graph of size b reads rows [:b] (row slices stay contiguous).
        # The int rows live in one buffer, so a step's are copied at once: ids, positions,
        # slots, lens, and each row's row of the persistent decode batch.
        self._static_ints = torch.zeros(5, max_size, dtype=torch.int32, device=device)
        self._static_ints[2].fill_(PADDING_SLOT)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.table_rows = (
            self._static_ints.unbind(0)
        )
        self.block_tables = torch.zeros(max_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        # The step's block tables, gathered inside the graph from the batch's rows kept here.
        self.row_tables = torch.zeros(decode_row_count(max_size), max_blocks_per_seq, dtype=torch.int32, device=device)
        # Host staging (pinned on CUDA, so the copies are async DMA): the int rows, and the
        # table entries that changed. Two sets, used in turn: with async scheduling the host
        # stages step N+1 while the copy of step N may not have run yet; the copy of step N-1
        # has (its results were read).
        pin = device.type == "cuda"
        self._host_ints = [torch.zeros(5, max_size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        changed_size = 3 * max_size * max_blocks_per_seq  # (row, column, block id) per entry sent
        self._host_changed = [torch.zeros(changed_size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._changed = torch.zeros(changed_size, dtype=torch.int32, device=device)
        self._num_staged = 0
        self._capture("decode", pool, device)

    def can_run(self, step: StepInputs) -> bool:
        """A decode-only step of the persistent batch (its tables fit the rows: the batch is as
        wide as these), of a size some graph takes."""
        return (
            step.is_decode_only
            and step.decode_rows is not None
            and graph_size_for(step.num_decodes, self.sizes) is not None
        )

    def run(self, step: StepInputs, fill_input_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """float32 logits [num_decodes, vocab] (a view of the graph's output: read it before
        the next step). `fill_input_ids` completes the staged ids on the device (placeholder
        tokens) before the replay."""
        size = graph_size_for(step.num_decodes, self.sizes)
        self._stage(step, size)
        if fill_input_ids is not None:
            fill_input_ids(self.input_ids)
        return self._run(size, step.num_decodes)

    def device_block_tables(self, step: StepInputs) -> torch.Tensor:
        """[num_decodes, max_blocks_per_seq] int32 on the device: the decodes' block tables,
        from the rows (the step's changes written first), for a step of the persistent batch
        that runs without a graph."""
        self._write_table_changes(step)
        (row_index,) = device_int32([step.decode_rows], self.device)
        return self.row_tables.index_select(0, row_index)

    def _stage(self, step: StepInputs, size: int) -> None:
        """The step's rows, then padding rows up to `size` (pad_decode_step's values, written in
        place: no padded lists)."""
        num_seqs = step.num_decodes
        self._write_table_changes(step)
        host_ints = self._host_ints[self._num_staged % 2]
        host = host_ints.numpy()
        host[0, :num_seqs] = step.input_ids
        host[1, :num_seqs] = step.positions
        host[2, :num_seqs] = step.slot_mapping
        host[3, :num_seqs] = step.decode_context_lens
        host[4, :num_seqs] = step.decode_rows
        host[:, num_seqs:size] = _PADDING_COLUMN
        self._static_ints.copy_(host_ints, non_blocking=True)  # rows past `size`: read by no graph

    def _write_table_changes(self, step: StepInputs) -> None:
        """The (row, column, block id) entries the step's batch changed, written into the rows
        on the device in one copy and one scatter, before what follows on the same stream.
        Every step of the batch comes here (graph or not), so the rows follow its mirror. Takes
        the step's turn of the staging buffers."""
        host_changed = self._host_changed[self._num_staged % 2]
        self._num_staged += 1
        changes = step.decode_table_changes
        if changes is None or not changes.shape[1]:
            return
        count = changes.shape[1]
        staged = host_changed[: 3 * count]
        staged.numpy()[:] = changes.reshape(-1)
        device_staged = self._changed[: 3 * count]
        device_staged.copy_(staged, non_blocking=True)
        self.row_tables[device_staged[:count], device_staged[count : 2 * count]] = device_staged[2 * count :]

    def _forward(self, size: int) -> torch.Tensor:
        torch.index_select(self.row_tables, 0, self.table_rows[:size], out=self.block_tables[:size])
        meta = self.metadata_for(self.slot_mapping[:size], self.block_tables[:size], self.context_lens[:size])
        return self.forward_logits(self.input_ids[:size], self.positions[:size], meta)


@torch.no_grad()  # nothing of the captured forward is kept for a backward
def capture_graphs(
    kind: str, sizes: tuple[int, ...], forward: Callable[[int], torch.Tensor], pool: GraphPool, device: torch.device
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One graph of `forward(size)` per size, largest first, into `pool`; (graphs, outputs) by
    size. The static inputs must hold values `forward` can run on eagerly (the warm-up)."""
    start = time.perf_counter()
    graphs, outputs = {}, {}
    for size in sorted(sizes, reverse=True):
        forward(size)  # warm-up: compiles the kernels, sets up cuBLAS for this shape
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = forward(size)
        graphs[size] = graph
    torch.cuda.synchronize(device)
    log.info("captured %d %s CUDA graphs (sizes %s) in %.1f s", len(graphs), kind, ",".join(map(str, sorted(sizes))),
             time.perf_counter() - start)
    return graphs, outputs

"""Piecewise CUDA graphs: the steps no whole-forward graph takes (decodes and prefill chunks in
one step, or several chunks) replay the model between its attention calls, per padded token count.

Why: such a step runs eagerly, ~10 launches per layer through Python (~250 for a 28-layer model:
~12 ms of host time on the H200 against a few ms of GPU work, engine/prefill_graphs.py), and
under load it is a common step: each arriving prompt joins the decoding batch as one. Its
attention cannot be captured whole (the decode and prefill kernels' grids follow the step's
sequences), but everything else in a layer is row-wise over the step's tokens: norms,
projections, RoPE and the KV-cache write, the MLP. So per padded size P there are L + 1 graphs
(L layers): piece 0 embeds the ids and computes layer 0's queries (storing its keys and values
in the cache); piece i finishes layer i - 1 after its attention and computes layer i's queries;
piece L finishes the last layer and the final norm. Between two pieces the step's attention
runs eagerly (AttentionBackend.attend_cached: the decode kernel for the leading decodes, the
prefill kernel for the chunks, each reading the step's metadata), and the logits of the rows
that sample are computed eagerly at the end. A step then costs L + 1 replays and ~2 attention
launches per layer instead of ~10 launches per layer.

The pieces pass their results through static buffers at the largest size (a size-P step uses
their first P rows): the queries, the residual stream, attention's output, the final hidden
states, and the RoPE tables piece 0 computes for every layer's cache write. Padding rows (P - n:
token 0, position 0, slot PADDING_SLOT) store nothing in the cache and are left unwritten by
attention; every op in a piece is row-wise, so their values never reach a real row (as in a
prefill graph). Tensor-parallel all-reduces sit inside the pieces, as in the decode graphs.

Graphs are captured largest size first into the pool the decode and prefill graphs share; only
one step runs at a time, so their temporaries share its memory. `PiecewiseGraphs(pool=None)`
runs the same pieces over the same buffers uncaptured: how the CPU tests check it against the
eager forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from llmserve.inference.engine.cuda_graphs import GraphPool, graph_batch_sizes, graph_size_for
from llmserve.inference.engine.static_inputs import StaticInputs
from llmserve.inference.models.attention_backend import PADDING_SLOT, AttentionBackend, KVLayer
from llmserve.inference.models.step_inputs import StepInputs
from llmserve.inference.models.transfers import device_int32

log = logging.getLogger(__name__)

# Up to 2048 tokens: past it a step's GPU work (~2k tokens of GEMMs) outlasts its eager launches.
# Finer steps at small sizes, where a step of a few decodes and a short chunk pays most for padding.
PIECEWISE_GRAPH_TOKEN_SIZES = (
    16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
)  # fmt: skip


def piecewise_graph_sizes(
    max_batched_tokens: int, sizes: tuple[int, ...] = PIECEWISE_GRAPH_TOKEN_SIZES
) -> tuple[int, ...]:
    """The sizes below the step budget, then the budget itself, up to the largest size."""
    return graph_batch_sizes(min(max_batched_tokens, sizes[-1]), sizes)


class PiecewiseGraphs:
    """Static inputs and buffers, and L + 1 graphs per padded token count, for a Llama-family
    model (models/llama.py: embed, its layers' attention_inputs and after_attention, final_norm)
    on a backend with store_kv and attend_cached."""

    def __init__(self, model: torch.nn.Module, kv_layers: list[KVLayer], attention: AttentionBackend,
                 sizes: tuple[int, ...], device: torch.device, pool: GraphPool | None):
        self.model = model
        self.layers = list(model.model.layers)
        self.kv_layers = kv_layers
        self.attention = attention
        self.sizes = tuple(sorted(sizes))
        self.device = device
        self.num_steps = 0  # steps run through the pieces (replays when captured)
        max_size = self.sizes[-1]
        self.inputs = StaticInputs({"input_ids": max_size, "positions": max_size, "slot_mapping": max_size}, device)
        # What the warm-up of every piece reads: nothing is stored in the cache.
        self.inputs.stage({"slot_mapping": [PADDING_SLOT] * max_size})
        self._buffers: dict[str, torch.Tensor] = {}  # by name, [max_size, ...]: allocated at the first run
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if pool is not None:
            self._capture(pool)

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    @property
    def captured_graphs(self) -> Mapping[int, tuple[torch.cuda.CUDAGraph, ...]]:
        """Each size's graphs, piece by piece (empty when uncaptured), read-only."""
        return MappingProxyType({size: tuple(graphs) for size, graphs in self._graphs.items()})

    def can_run(self, step: StepInputs) -> bool:
        return step.num_tokens <= self.sizes[-1]

    def run(self, step: StepInputs, meta, fill_input_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """float32 logits [len(step.logits_indices), vocab]. `meta`: the step's attention metadata
        (AttentionBackend.build_metadata), which the eager attention between the pieces reads.
        `fill_input_ids` completes the staged ids on the device (placeholder tokens)."""
        size = graph_size_for(step.num_tokens, self.sizes)
        num_pad = size - step.num_tokens
        self.inputs.stage({
            "input_ids": list(step.input_ids) + [0] * num_pad,
            "positions": list(step.positions) + [0] * num_pad,
            "slot_mapping": list(step.slot_mapping) + [PADDING_SLOT] * num_pad,
        })  # fmt: skip
        if fill_input_ids is not None:
            fill_input_ids(self.inputs.fields["input_ids"])
        self.num_steps += 1
        graphs = self._graphs.get(size)
        for index in range(self.num_pieces):
            if index:  # layer index - 1's attention, between the piece that stored its keys and the next
                attention = self.layers[index - 1].self_attn
                queries, attended = self._buffer_views(size)
                self.attention.attend_cached(queries, self.kv_layers[index - 1], meta, attention.scale,
                                             attention.sliding_window, attended)
            if graphs is None:
                self._piece(size, index)
            else:
                graphs[index].replay()
        (rows,) = device_int32([step.logits_indices], self.device)
        return self.model.compute_logits(self._buffers["final"].index_select(0, rows))

    def _buffer_views(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._buffers["queries"][:size], self._buffers["attended"][:size]

    def _piece(self, size: int, index: int) -> None:
        """Piece `index` of a size-`size` step, reading and writing the static buffers."""
        static = self.inputs.fields
        if index == 0:
            hidden, residual = self.model.embed(static["input_ids"][:size]), None
            rope = self.attention.rope_tables(static["positions"][:size], self.model.inv_freq, hidden.dtype)
            for position, table in enumerate(rope):
                self._store(f"rope{position}", table, size)
        else:
            attended, residual = self._buffer_views(size)[1], self._buffers["residual"][:size]
            hidden, residual = self.layers[index - 1].after_attention(attended, residual)
        if index == len(self.layers):
            self._store("final", self.model.final_norm(hidden, residual), size)
            return
        q, k, v, residual = self.layers[index].attention_inputs(hidden, residual)
        rope = (self._buffers["rope0"][:size], self._buffers["rope1"][:size])
        q = self.attention.store_kv(q, k, v, rope, self.kv_layers[index], static["slot_mapping"][:size])
        self._store("queries", q, size)
        self._store("residual", residual, size)
        if "attended" not in self._buffers:  # attention's output: the queries' shape (attend's empty_like)
            self._buffers["attended"] = torch.zeros_like(self._buffers["queries"])

    def _store(self, name: str, value: torch.Tensor, size: int) -> None:
        buffer = self._buffers.get(name)
        if buffer is None:  # at the first run, before any capture (the largest size's warm-up)
            buffer = self._buffers[name] = torch.zeros(
                (self.sizes[-1], *value.shape[1:]), dtype=value.dtype, device=value.device
            )
        buffer[:size].copy_(value)

    @torch.no_grad()
    def _capture(self, pool: GraphPool) -> None:
        """Each size's pieces, largest size first; each piece warmed up eagerly (kernels compiled,
        buffers allocated), then captured."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            graphs = []
            for index in range(self.num_pieces):
                self._piece(size, index)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(size, index)
                graphs.append(graph)
            self._graphs[size] = graphs
        torch.cuda.synchronize(self.device)
        log.info("captured %d piecewise CUDA graphs (%d pieces x sizes %s) in %.1f s",
                 len(self.sizes) * self.num_pieces, self.num_pieces, ",".join(map(str, self.sizes)),
                 time.perf_counter() - start)

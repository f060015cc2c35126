"""Runs the model on one scheduled batch: builds the flat inputs, runs the forward over the
paged KV cache, and returns logits only for the sequences that sample this step.

Inputs for a step (engine/batch_inputs.py builds them on the host, the engine hands them over;
copied to the device once):
  input_ids, positions   [num_tokens]: single-token sequences first, then prefill chunks;
  slot_mapping           [num_tokens]: where each new token's K/V go;
  per decode / prefill chunk: block tables and context lengths (attention metadata);
  logits_indices         [num_sampling]: the last token of each sampling sequence, in batch order.

The attention backend (models/attention_backend.py) is chosen once, from
EngineConfig.attention_backend, and handed to the model; each step the runner asks it for the
step's attention metadata. Where the backend supports them (triton), decode-only steps replay a
CUDA graph per decode batch size (engine/cuda_graphs.py) and small single-chunk prefill steps
one per padded token count (engine/prefill_graphs.py), all in one memory pool, unless
enforce_eager. With piecewise_graphs (the default), the other steps of up to 2048 tokens replay the
model's pieces between its attention calls (engine/piecewise_graphs.py); the rest run eagerly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import numpy as np
import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from llmserve.inference.engine.kv_cache import KVCache, KVCacheSpec, plan_num_blocks
from llmserve.inference.engine.kv_pool_export import KvPoolExport
from llmserve.inference.models.transfers import device_int32, device_tensor
from llmserve.inference.engine.piecewise_graphs import PiecewiseGraphs, piecewise_graph_sizes
from llmserve.inference.engine.prefill_graphs import PrefillGraphs, prefill_graph_sizes
from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.models.step_inputs import StepInputs
from llmserve.inference.models.attention_backend import (
    PADDING_SLOT,
    create_attention_backend,
    resolve_attention_backend,
)
from llmserve.inference.models.decoder_config import DecoderConfig
from llmserve.inference.models.loader import load_model, torch_dtype
from llmserve.inference.models.quantization import quantize_linears
from llmserve.inference.models.rank_group import SINGLE_RANK, RankGroup
from llmserve.inference.models.tensor_parallel import TensorParallel
from llmserve.inference.engine.step_broadcast import StepBroadcast
from llmserve.model_files import ModelFiles

log = logging.getLogger(__name__)

RANKS_OUT_OF_STEP_EXIT_CODE = 70  # rank 0 of a split engine, after a step that failed


class ModelRunner:
    """`ranks`: the tensor-parallel group this runner is one rank of (models/rank_group.py). Every
    rank builds its slice of the model and its own KV pool of the same number of blocks; rank 0's
    `execute` first broadcasts the step (engine/step_broadcast.py), which the other ranks run
    with `execute_step` (engine/rank_worker.py)."""

    def __init__(self, config: EngineConfig, files: ModelFiles, max_context_tokens: int,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None, ranks: RankGroup = SINGLE_RANK):
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.block_size_tokens
        self.max_context_tokens = max_context_tokens
        self.model_config = DecoderConfig.from_hf(files.config)
        tp = TensorParallel(self.model_config, ranks)
        local_config = tp.local_config()  # this rank's heads, KV heads and vocabulary rows
        self._step_broadcast = StepBroadcast(ranks, self.device) if ranks.size > 1 and ranks.is_leader else None
        log.info("loading %s (%s) on %s as %s", files.path, files.architecture, self.device, config.dtype)
        attention_name = resolve_attention_backend(config.attention_backend, self.device)
        self.attention = create_attention_backend(attention_name, local_config, self.block_size, self.device)
        if config.kv_cache_dtype == "fp8" and not self.attention.supports_fp8_kv_cache:
            raise ValueError(f"kv_cache_dtype 'fp8' needs the triton attention backend, not {self.attention.name!r}")
        self.model = load_model(files.path, local_config, self.device, self.dtype, self.attention, weights, tp)
        if config.quantization != "none":
            # Before sizing the KV pool: the freed bf16 matrices become KV blocks.
            log.info("quantizing the linear layers: %s", config.quantization)
            quantize_linears(self.model, config.quantization)  # also empties the CUDA allocator's cache
        spec = KVCacheSpec(
            num_layers=self.model_config.num_layers,
            block_size=self.block_size,
            num_kv_heads=local_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype,
        )
        num_blocks = plan_num_blocks(
            spec,
            self.device,
            num_blocks=config.num_kv_blocks,
            cpu_memory_bytes=config.kv_cpu_memory_bytes,
            memory_fraction=config.kv_memory_fraction,
            max_useful_blocks=config.max_num_seqs * self.max_blocks_per_seq,
        )
        num_blocks = ranks.min_int(num_blocks)  # one block table addresses every rank's pool
        export = KvPoolExport(self.device) if config.kv_pull else None
        self.kv_cache = KVCache(spec, num_blocks, self.device, export)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d bytes per block)",
            num_blocks, self.block_size, num_blocks * self.block_size, self.kv_cache.num_bytes / 2**20,
            spec.dtype, spec.bytes_per_block,
        )
        if self.attention.needs_warm_up:
            self._warm_up_prefill()
            self.attention.warm_up(self.kv_cache.layers[0], self.dtype)
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        if self.attention.supports_cuda_graphs and not config.enforce_eager:
            # Off CUDA (the Triton interpreter in tests) the static-buffer paths run uncaptured.
            self.decode_graphs, self.prefill_graphs, self.piecewise_graphs = self._cuda_graphs(config)
        log.info(
            "attention backend: %s; decode CUDA graphs (batch sizes): %s; prefill CUDA graphs (tokens): %s; "
            "piecewise CUDA graphs (tokens): %s",
            self.attention.name, _sizes_text(self.decode_graphs), _sizes_text(self.prefill_graphs),
            _sizes_text(self.piecewise_graphs),
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def max_blocks_per_seq(self) -> int:
        """The width of a block table: the longest context a sequence may have, in blocks."""
        return -(-self.max_context_tokens // self.block_size)

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, step: StepInputs, launched_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits [num_sampling_seqs, vocab]: one row per sequence that samples, in batch
        order; `step` is the batch's inputs (build_step_inputs). `launched_tokens`: the in-flight
        step's sampled ids (on the device), where the placeholder input tokens of this batch are
        read from. Queues the work; does not wait. Split over ranks, the other ranks get the
        step first and run it alongside."""
        if self._step_broadcast is None:
            return self.execute_step(batch.block_copies, step, launched_tokens)
        try:
            self._step_broadcast.send(batch.block_copies, step, launched_tokens)
            return self.execute_step(batch.block_copies, step, launched_tokens)
        except Exception:  # noqa: BLE001
            # The other ranks wait in a collective this rank will never join (or one of them
            # is gone): no later step can run. Ending the process ends the engine, and the
            # server, which watches every rank, fails its requests saying which rank died.
            log.critical("a tensor-parallel step failed on rank 0: the ranks are out of step", exc_info=True)
            os._exit(RANKS_OUT_OF_STEP_EXIT_CODE)

    @torch.inference_mode()
    def execute_step(
        self, block_copies: list[tuple[int, int]], step: StepInputs, launched_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`execute` on the step's parts: what every rank runs."""
        self.kv_cache.copy_blocks(block_copies)
        fill = self._placeholder_filler(step, launched_tokens)
        if self.decode_graphs is not None and self.decode_graphs.can_run(step):
            return self._sampled_rows(self.decode_graphs.run(step, fill), step.logits_indices)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(step):
            return self.prefill_graphs.run(step, fill)
        # A mixed step (decodes and a prefill chunk) runs eagerly: its decodes' block tables come
        # from the decode graphs' rows on the device, its lists in one copy each side.
        decode_tables = None
        if self.decode_graphs is not None and step.num_decodes and step.decode_rows is not None:
            decode_tables = self.decode_graphs.device_block_tables(step)
        meta = self.attention.build_metadata(step, decode_tables)
        if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(step):
            return self.piecewise_graphs.run(step, meta, fill)
        input_ids, positions, logits_indices = device_int32(
            [step.input_ids, step.positions, step.logits_indices], self.device
        )
        if fill is not None:
            fill(input_ids)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden[logits_indices])

    def stop_ranks(self) -> None:
        """Rank 0: tell the other ranks that no step follows (they leave their loop)."""
        if self._step_broadcast is not None:
            self._step_broadcast.stop()

    def _placeholder_filler(self, step: StepInputs, launched_tokens: torch.Tensor | None):
        """A function that writes the step's placeholder input ids into a device ids tensor, or None."""
        num_rows = len(step.placeholder_rows)
        if not num_rows:
            return None
        assert launched_tokens is not None, "a placeholder input token without the step that samples it"
        if _is_first_rows(step.placeholder_rows) and _is_first_rows(step.placeholder_source_rows):
            # Steady decoding: the same sequences in the same order as the step before.
            return lambda input_ids: input_ids[:num_rows].copy_(launched_tokens[:num_rows])
        rows, source_rows = self._to_device(step.placeholder_rows), self._to_device(step.placeholder_source_rows)
        return lambda input_ids: input_ids.index_copy_(0, rows, launched_tokens[source_rows].to(input_ids.dtype))

    @torch.inference_mode()
    def _warm_up_prefill(self, num_tokens: int = 32) -> None:
        """Compile the prefill-path kernels now rather than during the first request: one
        chunk whose slots are all padding (nothing is written; it reads block 0, zeros)."""
        step = StepInputs(
            input_ids=[0] * num_tokens, positions=list(range(num_tokens)), slot_mapping=[PADDING_SLOT] * num_tokens,
            prefill_query_starts=[0], prefill_query_lens=[num_tokens], prefill_context_lens=[num_tokens],
            prefill_block_tables=[[0] * -(-num_tokens // self.block_size)], prefill_has_cached_prefix=[False],
            logits_indices=[num_tokens - 1],
        )
        hidden = self.model(self._to_device(step.input_ids), self._to_device(step.positions), self.kv_cache.layers,
                            self.attention.build_metadata(step))
        self.model.compute_logits(hidden[-1:])

    # --- CUDA graphs --------------------------------------------------------------------------

    def _cuda_graphs(self, config: EngineConfig) -> tuple[DecodeGraphs, PrefillGraphs, PiecewiseGraphs | None]:
        """Decode graphs, prefill graphs, then piecewise graphs where asked for, captured into one
        pool (on CUDA)."""
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        common = dict(max_blocks_per_seq=self.max_blocks_per_seq, device=self.device, pool=pool)
        decode = DecodeGraphs(self._forward_logits, graph_batch_sizes(config.max_num_seqs),
                              metadata_for=self.attention.decode_graph_metadata, **common)
        prefill = PrefillGraphs(self._forward_rows, prefill_graph_sizes(config.max_batched_tokens),
                                metadata_for=self.attention.prefill_graph_metadata, **common)
        piecewise = None
        if config.piecewise_graphs:
            piecewise = PiecewiseGraphs(self.model, self.kv_cache.layers, self.attention,
                                        piecewise_graph_sizes(config.max_batched_tokens), self.device, pool)
        return decode, prefill, piecewise

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache.layers, meta))

    def _forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, rows: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _sampled_rows(self, logits: torch.Tensor, logits_indices: list[int]) -> torch.Tensor:
        """A decode-only step's rows are its sequences in batch order; a single-token prefill
        chunk (budget remainder) is among them but does not sample."""
        if logits_indices == list(range(logits.shape[0])):
            return logits
        return logits[self._to_device(logits_indices)]

    def _to_device(self, values: list) -> torch.Tensor:
        return device_tensor(values, self.device)


def _is_first_rows(rows) -> bool:
    """Whether `rows` (a list or an array) is 0, 1, ..., len - 1."""
    return np.array_equal(rows, np.arange(len(rows)))


def _sizes_text(graphs: DecodeGraphs | PrefillGraphs | PiecewiseGraphs | None) -> str:
    return "off" if graphs is None else ",".join(map(str, graphs.sizes))

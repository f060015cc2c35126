"""Runs the model on one scheduled batch: builds the flat inputs, runs the forward over the
paged KV cache, and returns logits only for the sequences that sample this step.

Inputs for a step (all built on the host from the batch, copied to the device once):
  input_ids, positions   [num_tokens]: single-token sequences first, then prefill chunks;
  slot_mapping           [num_tokens]: where each new token's K/V go;
  decode slot tables     [num_decodes, max_blocks * block_size] + context lengths;
  prefill chunk slices (host ints) + slot lists of chunks with a cached prefix;
  logits_indices         [num_sampling]: the last token of each sampling sequence, in batch order.
"""

from __future__ import annotations

import logging

import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.kv_cache import KVCache, KVCacheSpec, device_tensor, plan_num_blocks
from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.models.attention import AttentionMetadata, PrefillChunk
from llmserve.inference.models.llama import DecoderConfig
from llmserve.inference.models.loader import load_model, torch_dtype
from llmserve.model_files import ModelFiles

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, files: ModelFiles, max_model_len: int):
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.block_size_tokens
        self.model_config = DecoderConfig.from_hf(files.config)
        log.info("loading %s (%s) on %s as %s", files.path, files.architecture, self.device, config.dtype)
        self.model = load_model(files.path, self.model_config, self.device, self.dtype)
        spec = KVCacheSpec(
            num_layers=self.model_config.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.dtype,
        )
        num_blocks = plan_num_blocks(
            spec,
            self.device,
            num_blocks=config.num_kv_blocks,
            cpu_memory_bytes=config.kv_cpu_memory_bytes,
            memory_fraction=config.kv_memory_fraction,
            max_useful_blocks=config.max_num_seqs * -(-max_model_len // self.block_size),
        )
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d bytes per block)",
            num_blocks, self.block_size, num_blocks * self.block_size, self.kv_cache.num_bytes / 2**20,
            config.dtype, spec.bytes_per_block,
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits [num_sampling_seqs, vocab]: one row per sequence that samples, in batch order."""
        self.kv_cache.copy_blocks(batch.block_copies)
        input_ids, positions, meta, logits_indices = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden[logits_indices])

    def _prepare(self, batch: ScheduledBatch):
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] > 1)  # decodes first
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: dict[int, int] = {}  # batch index -> flat row of its last token
        decode_tables: list[list[int]] = []
        decode_context_lens: list[int] = []
        prefills: list[tuple[int, int, int, list[int] | None]] = []
        for i in order:
            seq, num_new = batch.seqs[i], batch.num_new_tokens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            query_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slot(seq.block_ids, p) for p in range(start, end))
            last_rows[i] = len(input_ids) - 1
            if num_new == 1:
                decode_tables.append(seq.block_ids[: -(-end // self.block_size)])
                decode_context_lens.append(end)
            else:
                cached_table = seq.block_ids[: -(-end // self.block_size)] if start > 0 else None
                prefills.append((query_start, num_new, end, cached_table))
        logits_indices = [last_rows[i] for i in range(len(batch.seqs)) if batch.samples(i)]
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            num_decode_tokens=len(decode_tables),
            decode_kv_slots=self._slot_table(decode_tables) if decode_tables else None,
            decode_context_lens=self._to_device(decode_context_lens) if decode_tables else None,
            prefills=[
                PrefillChunk(row, n, context_len, None if table is None else self._slot_table([table])[0, :context_len])
                for row, n, context_len, table in prefills
            ],
        )
        return self._to_device(input_ids), self._to_device(positions), meta, self._to_device(logits_indices)

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _slot_table(self, block_tables: list[list[int]]) -> torch.Tensor:
        """[num_seqs, max_blocks * block_size] cache slots of every position, padded with block 0."""
        width = max(len(table) for table in block_tables)
        padded = [table + [0] * (width - len(table)) for table in block_tables]
        blocks = self._to_device(padded)  # [num_seqs, max_blocks]
        offsets = torch.arange(self.block_size, device=self.device)
        return (blocks[:, :, None] * self.block_size + offsets).reshape(len(block_tables), -1)

    def _to_device(self, values: list) -> torch.Tensor:
        return device_tensor(values, self.device)

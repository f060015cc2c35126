"""The triton attention backend (CUDA; Triton's interpreter in the CPU tests): RoPE fused with
the KV-cache write, then paged decode for the leading single-token rows and paged prefill for
the chunks, both reading K/V in place through the block tables (kernels/); the small ops are
the Triton ones (models/triton_ops.py).

It also serves a float8 (e4m3) KV cache, skips negative (padding) slots when writing, and
builds its decode and one-chunk prefill metadata over static buffers, so those steps replay as
CUDA graphs (engine/cuda_graphs.py, engine/prefill_graphs.py). Its attention splits in two
(store_kv, which reads only static buffers, and attend_cached), so other steps can replay the
model between attention calls (engine/piecewise_graphs.py). Imports triton: imported only when
chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.inference.models.step_inputs import StepInputs, pad_rows
from llmserve.inference.models.transfers import device_int32
from llmserve.inference.kernels.paged_decode import decode_num_splits, paged_decode_attention
from llmserve.inference.kernels.paged_prefill import paged_prefill_attention, prefill_num_splits
from llmserve.inference.kernels.rope_kv import rope_and_write_kv
from llmserve.inference.kernels.split_kv import SPLIT_COUNTS
from llmserve.inference.models.attention_backend import AttentionBackend, KVLayer, RopeTables
from llmserve.inference.models.decoder_config import DecoderConfig
from llmserve.inference.models.rope import half_width_tables
from llmserve.inference.models.triton_ops import TRITON_OPS

CPU_NUM_SMS = 4  # the Triton interpreter (CPU tests): a few decode splits still get exercised


@dataclass(slots=True)
class TritonAttentionMetadata:
    """What the Triton kernels read for one step. Tensors are int32 on the device; the same
    object, built over static buffers, is captured in a CUDA graph, so nothing here may
    need a host value that changes between replays (the host ints are fixed per graph: a
    prefill graph's max query length is its padded size)."""

    slot_mapping: torch.Tensor  # [num_tokens]: cache slot of each new token, -1 = padding row
    num_decode_tokens: int  # the leading tokens, one per single-token sequence
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor | None  # [num_decodes], the new token included; 0 = padding
    decode_num_splits: int = 1  # context splits of the decode kernel
    prefill_block_tables: torch.Tensor | None = None  # [num_chunks, max_blocks]
    prefill_query_starts: torch.Tensor | None = None  # [num_chunks]: first row in the flat batch
    prefill_query_lens: torch.Tensor | None = None  # [num_chunks]
    prefill_context_lens: torch.Tensor | None = None  # [num_chunks]: cached prefix + chunk
    prefill_max_query_len: int = 0  # sizes the prefill kernel's grid
    prefill_num_splits: int = 1  # key splits of the prefill kernel


class TritonAttention(AttentionBackend[TritonAttentionMetadata]):
    name = "triton"
    ops = TRITON_OPS
    supports_fp8_kv_cache = True
    needs_warm_up = True
    supports_cuda_graphs = True

    def __init__(self, config: DecoderConfig, block_size: int, device: torch.device):
        super().__init__(config, block_size, device)
        is_cuda = device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else CPU_NUM_SMS

    def build_metadata(
        self, step: StepInputs, decode_block_tables: torch.Tensor | None = None
    ) -> TritonAttentionMetadata:
        """All of the step's lists in one copy (transfers.device_int32); `decode_block_tables`:
        the decodes' tables already on the device (the decode graphs' rows), else sent too."""
        num_decodes, has_prefill = step.num_decodes, not step.is_decode_only
        lists = [step.slot_mapping, step.decode_context_lens]
        if has_prefill:
            lists += [step.prefill_query_starts, step.prefill_query_lens, step.prefill_context_lens,
                      _flat_rows(step.prefill_block_tables)]
        if num_decodes and decode_block_tables is None:
            lists.append(_flat_rows(step.decode_block_tables))
        tensors = iter(device_int32(lists, self.device))
        slot_mapping, decode_context_lens = next(tensors), next(tensors)
        meta = TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=num_decodes,
            decode_block_tables=None,
            decode_context_lens=decode_context_lens if num_decodes else None,
            decode_num_splits=self._decode_num_splits(num_decodes),
        )
        if has_prefill:
            meta.prefill_query_starts, meta.prefill_query_lens = next(tensors), next(tensors)
            meta.prefill_context_lens = next(tensors)
            meta.prefill_block_tables = next(tensors).view(len(step.prefill_block_tables), -1)
            meta.prefill_max_query_len = max(step.prefill_query_lens)
            meta.prefill_num_splits = self._prefill_num_splits(
                meta.prefill_max_query_len, len(step.prefill_query_lens), max(step.prefill_context_lens)
            )
        if num_decodes:
            meta.decode_block_tables = (
                decode_block_tables if decode_block_tables is not None else next(tensors).view(num_decodes, -1)
            )
        return meta

    def decode_graph_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> TritonAttentionMetadata:
        size = slot_mapping.shape[0]
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=size,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            decode_num_splits=self._decode_num_splits(size),
        )

    def prefill_graph_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_starts: torch.Tensor,
        query_lens: torch.Tensor, context_lens: torch.Tensor,
    ) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=0,
            decode_block_tables=None,
            decode_context_lens=None,
            prefill_block_tables=block_tables,
            prefill_query_starts=query_starts,
            prefill_query_lens=query_lens,
            prefill_context_lens=context_lens,
            prefill_max_query_len=slot_mapping.shape[0],
            # Fixed per graph: chosen for the longest context the block table can hold.
            prefill_num_splits=self._prefill_num_splits(slot_mapping.shape[0], 1, block_tables.shape[1] * self.block_size),
        )

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        return half_width_tables(positions, inv_freq)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeTables, kv_cache: KVLayer,
               meta: TritonAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        q = self.store_kv(q, k, v, rope, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        self.attend_cached(q, kv_cache, meta, scale, sliding_window, out)
        return out

    def store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeTables, kv_cache: KVLayer,
                 slot_mapping: torch.Tensor) -> torch.Tensor:
        cos, sin = rope
        k_cache, v_cache = kv_cache
        return rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def attend_cached(self, q: torch.Tensor, kv_cache: KVLayer, meta: TritonAttentionMetadata, scale: float,
                      sliding_window: int | None, out: torch.Tensor) -> None:
        k_cache, v_cache = kv_cache
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            paged_decode_attention(
                q[:num_decodes], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                scale, num_splits=meta.decode_num_splits, sliding_window=sliding_window, out=out[:num_decodes],
            )
        if meta.prefill_max_query_len:
            paged_prefill_attention(
                q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_starts, meta.prefill_query_lens,
                meta.prefill_context_lens, meta.prefill_max_query_len, scale, sliding_window=sliding_window, out=out,
                num_splits=meta.prefill_num_splits, first_row=num_decodes,
            )

    def warm_up(self, kv_cache: KVLayer, dtype: torch.dtype) -> None:
        """Each split count either kernel can take (SPLIT_COUNTS: decode_num_splits and
        prefill_num_splits give only those), with and without a sliding window where the model's
        layers differ: one query row over one key of block 0, nothing written. The graphs'
        captures compile only the counts of their sizes; an eager step (decodes beside a prompt
        chunk, of any batch size) may need the others."""
        k_cache, v_cache = kv_cache
        q = torch.zeros(1, self.config.num_heads, self.config.head_dim, dtype=dtype, device=self.device)
        out = torch.empty_like(q)
        block_table, zero, one = device_int32([[0], [0], [1]], self.device)
        block_table = block_table.view(1, 1)
        for window in set(self.config.sliding_windows) or {None}:
            for num_splits in SPLIT_COUNTS:
                paged_decode_attention(q, k_cache, v_cache, block_table, one, 1.0, num_splits=num_splits,
                                       sliding_window=window, out=out)
                paged_prefill_attention(q, k_cache, v_cache, block_table, zero, one, one, 1, 1.0,
                                        sliding_window=window, out=out, num_splits=num_splits)

    def _decode_num_splits(self, num_decodes: int) -> int:
        return decode_num_splits(num_decodes, self.config.num_kv_heads, self.num_sms)

    def _prefill_num_splits(self, max_query_len: int, num_chunks: int, max_context_len: int) -> int:
        return prefill_num_splits(max_query_len, num_chunks, self.config.num_heads, max_context_len, self.num_sms)


def _flat_rows(rows: list[list[int]]) -> list[int]:
    """The rows right-padded with block 0 to the widest, concatenated."""
    width = max(len(row) for row in rows)
    return [value for row in pad_rows(rows, width) for value in row]

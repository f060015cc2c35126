"""The attention backend: one object, chosen once at start, through which the model runs
attention over the paged KV cache and its small per-layer ops.

A backend owns everything that differs between attention implementations:
  build_metadata          a step's host inputs (models/step_inputs.StepInputs) -> the device
                          metadata its attention reads, built once per step, shared by layers;
  rope_tables / attend    the cos/sin layout it wants, and attention for one layer: rotate q/k,
                          write the new k/v to their cache slots, attend;
  ops                     the small ops (models/layer_ops.LayerOps): its fused kernels, or
                          REFERENCE_OPS where it has none;
  decode_graph_metadata,  (supports_cuda_graphs) metadata over static device buffers, for the
  prefill_graph_metadata  decode and prefill CUDA graphs (engine/cuda_graphs.py, prefill_graphs.py).

Implementations, one file each, named in BACKENDS:
  portable  models/portable_attention.py: any device; keys/values gathered through slot tables,
            torch SDPA, the small ops as transformers runs them (the reference);
  triton    models/triton_attention.py: CUDA (or Triton's interpreter); paged kernels reading the
            blocks in place, RoPE fused with the KV write, fused small ops, CUDA graphs,
            float8 KV cache.

Adding one (FlashInfer, an FA3-style fp8 kernel) is a new file with an AttentionBackend
subclass, its entry in BACKENDS and its name in engine/config.ATTENTION_BACKENDS: the model,
the model runner and the CUDA graphs do not change. The model never asks which backend it has.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from llmserve.inference.models.transfers import device_tensor
from llmserve.inference.models.step_inputs import StepInputs, pad_rows
from llmserve.inference.models.decoder_config import DecoderConfig
from llmserve.inference.models.layer_ops import LayerOps

# The slot of a padding row (CUDA-graph spare rows, the warm-up prefill): a backend that takes
# them (supports_cuda_graphs, needs_warm_up) writes nothing to the cache for it.
PADDING_SLOT = -1
MetadataT = TypeVar("MetadataT")
RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of the step's positions
KVLayer = tuple[torch.Tensor, torch.Tensor]  # (k, v) [num_blocks, block_size, num_kv_heads, head_dim]


class AttentionBackend(ABC, Generic[MetadataT]):
    """Built once per engine for one model shape, block size and device (the runner calls
    create_attention_backend); the model takes it at construction."""

    name: ClassVar[str]
    ops: ClassVar[LayerOps]
    supports_fp8_kv_cache: ClassVar[bool] = False
    # Its kernels compile on first launch: the runner runs one prefill at start whose slots
    # are all PADDING_SLOT, which the backend must then skip when writing the cache.
    needs_warm_up: ClassVar[bool] = False
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, config: DecoderConfig, block_size: int, device: torch.device):
        self.config = config
        self.block_size = block_size
        self.device = device

    @abstractmethod
    def build_metadata(self, step: StepInputs, decode_block_tables: torch.Tensor | None = None) -> MetadataT:
        """The step's attention metadata on the device (no hidden host sync). `decode_block_tables`
        [num_decodes, width] int32: the decodes' block tables when already on the device (the
        decode graphs keep them in the persistent batch's rows, engine/decode_batch.py); only where
        supports_cuda_graphs."""

    @abstractmethod
    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin for `positions` [num_tokens] in the layout `attend` takes; `dtype`: the model's."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
        v: torch.Tensor,
        rope: RopeTables,
        kv_cache: KVLayer,
        meta: MetadataT,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """[num_tokens, num_heads, head_dim]: rotate q/k, store k/v at their slots, attend."""

    def warm_up(self, kv_cache: KVLayer, dtype: torch.dtype) -> None:
        """Compile now every variant of the attention kernels a step may launch (where kernels
        compile on first launch, a variant first met mid-request costs that request the compile).
        `kv_cache`: a layer of the pool, only read; `dtype`: the queries'. Only where needs_warm_up."""

    def store_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeTables, kv_cache: KVLayer,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """`attend`'s first half: the rotated queries [num_tokens, num_heads, head_dim]; the rotated
        keys and the values stored at `slot_mapping` (PADDING_SLOT rows: nothing stored). It reads
        no host value of the step, so a piecewise CUDA graph captures it (engine/piecewise_graphs.py).
        Only where supports_cuda_graphs."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")

    def attend_cached(
        self, q: torch.Tensor, kv_cache: KVLayer, meta: MetadataT, scale: float, sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        """`attend`'s second half: the rotated queries `q` attend to the cache (their own keys
        stored by store_kv), into `out` [num_tokens, num_heads, head_dim]. Rows the metadata
        names no sequence for (padding) are left unwritten. Only where supports_cuda_graphs."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")

    def decode_graph_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> MetadataT:
        """Metadata of a decode-only step over static int32 device buffers (slot_mapping and
        context_lens [size], block_tables [size, max_blocks]; padding rows: PADDING_SLOT and
        context length 0),
        captured in a CUDA graph: nothing in it may depend on a host value that changes
        between replays. Only where supports_cuda_graphs."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")

    def prefill_graph_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_starts: torch.Tensor,
        query_lens: torch.Tensor, context_lens: torch.Tensor,
    ) -> MetadataT:
        """Metadata of a one-chunk prefill step over static int32 device buffers, captured in a
        CUDA graph: slot_mapping [size] (the chunk's rows, then PADDING_SLOT rows), block_tables
        [1, max_blocks], query_starts/query_lens/context_lens [1] (any context length up to
        max_blocks * block_size). Only where supports_cuda_graphs."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")

    def _to_device(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return device_tensor(values, self.device, dtype)

    def _block_table(self, block_tables: list[list[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
        """[num_seqs, max_blocks] block ids, rows right-padded with block 0."""
        return self._to_device(pad_rows(block_tables, max(len(t) for t in block_tables)), dtype)


@dataclass(frozen=True, slots=True)
class BackendEntry:
    module: str  # imported only when chosen: a kernel backend imports its kernel package
    class_name: str
    package: str | None = None  # a package it needs, checked before the import


BACKENDS = {
    "portable": BackendEntry("llmserve.inference.models.portable_attention", "PortableAttention"),
    "triton": BackendEntry("llmserve.inference.models.triton_attention", "TritonAttention", package="triton"),
}
AUTO_ON_CUDA = "triton"  # "auto" on CUDA when its package imports; "portable" everywhere else


def resolve_attention_backend(requested: str, device: torch.device) -> str:
    """The backend name for EngineConfig.attention_backend (`auto` or a name in BACKENDS) on `device`."""
    if requested == "auto":
        return AUTO_ON_CUDA if device.type == "cuda" and _is_installed(BACKENDS[AUTO_ON_CUDA]) else "portable"
    entry = BACKENDS[requested]
    if not _is_installed(entry):
        raise ValueError(f"attention_backend {requested!r} needs the {entry.package} package")
    return requested


def create_attention_backend(
    name: str, config: DecoderConfig, block_size: int, device: torch.device
) -> AttentionBackend:
    entry = BACKENDS[name]
    backend_cls = getattr(importlib.import_module(entry.module), entry.class_name)
    return backend_cls(config, block_size, device)


def _is_installed(entry: BackendEntry) -> bool:
    return entry.package is None or importlib.util.find_spec(entry.package) is not None

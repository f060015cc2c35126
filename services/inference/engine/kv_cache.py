"""The paged KV cache tensors, and how many blocks fit in the memory we are given.

Layout: one allocation [2 (k, v), num_layers, num_blocks, block_size, num_kv_heads, head_dim].
Layer i reads views data[0, i] and data[1, i] of shape [num_blocks, block_size, num_kv_heads,
head_dim] (a block's tokens are contiguous, so a slot is block_id * block_size + offset in the
flattened view). One tensor rather than 2 x num_layers: one allocation to size and log, and a
block copy (copy-on-fork) is a single indexing op over every layer at once.

The pool is zero-filled, not left uninitialized: padded attention reads (masked keys) must be
finite, since 0 * NaN would leak NaN through the masked softmax.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmserve.inference.engine.kv_pool_export import KvPoolExport
from llmserve.inference.models.transfers import device_tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element_bytes = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_bytes


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device, export: KvPoolExport | None = None):
        """`export`: allocate the pool in its transport region (--kv-pull), so that other
        replicas can read its blocks."""
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (2, spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if export is None:
            self.data = torch.zeros(shape, dtype=spec.dtype, device=device)
        else:
            self.data = export.allocate(shape, spec.dtype)
        self.export = export
        self.layers = [(self.data[0, i], self.data[1, i]) for i in range(spec.num_layers)]

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, k and v): copies are (src, dst) block ids."""
        if not copies:
            return
        src = device_tensor([s for s, _ in copies], self.data.device)
        dst = device_tensor([d for _, d in copies], self.data.device)
        data = self.data.view(torch.uint8) if self.data.element_size() == 1 else self.data  # float8: raw bytes
        data[:, :, dst] = data[:, :, src]


def plan_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    *,
    num_blocks: int | None,
    cpu_memory_bytes: int,
    memory_fraction: float,
    max_useful_blocks: int,
) -> int:
    """Blocks for the pool: an explicit count wins; on CUDA, `memory_fraction` of the device's
    memory minus what is already in use (weights); on CPU a byte budget, capped at
    `max_useful_blocks` (every sequence slot at full context), since CPU RAM is shared.
    """
    if num_blocks is not None:
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_blocks}")
        return num_blocks
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        budget_bytes = int(total_bytes * memory_fraction) - (total_bytes - free_bytes)
        planned = budget_bytes // spec.bytes_per_block
    else:
        budget_bytes = cpu_memory_bytes
        planned = min(budget_bytes // spec.bytes_per_block, max_useful_blocks)
    if planned <= 0:
        raise ValueError(
            f"no room for a KV block: budget {budget_bytes} bytes, one block needs {spec.bytes_per_block} bytes"
        )
    return planned

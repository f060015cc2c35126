"""Copy whole KV blocks from one paged pool to another in one launch: the KV pull's copy.

Both pools are laid out as the engine's KV cache, [2 (k, v), num_layers, num_blocks, *block],
with each block's tokens contiguous (`block` elements: block_size x num_kv_heads x head_dim).
Pair p of (source id, target id) copies, for every layer's k and v, the source's block into the
target's: one program per (pair, k/v and layer, tile of the block), each reading and writing
its tile once.

Why a kernel: the torch gather it replaces (index_select into a temporary, then index_copy_)
moves every byte twice and indexes element by element; on the H200 an 8k-token pull of the 8B
shape (1,057 MB) copied at 211 GB/s with it, against the issue's 1 TB/s. The pools may hold
different numbers of blocks (the source is another replica's); they must share a device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements per program (8 KiB of bfloat16, 16 elements per thread at 8 warps) and warps: on an
# H100 tiles of 1k-16k elements at 4-16 warps were within ~3% of each other but 1k x 16 warps,
# and this one the best or within 2% (bench/bench_block_copy.py --sweep).
TILE = 4096
NUM_WARPS = 8


@triton.jit
def _copy_blocks_kernel(
    source_ptr, target_ptr, source_ids_ptr, target_ids_ptr,
    source_stride_kv, source_stride_layer, source_stride_block,
    target_stride_kv, target_stride_layer, target_stride_block,
    NUM_LAYERS: tl.constexpr, BLOCK_ELEMENTS: tl.constexpr, TILE: tl.constexpr,
):
    pair = tl.program_id(0)
    kv_layer = tl.program_id(1)
    kv = kv_layer // NUM_LAYERS
    layer = kv_layer % NUM_LAYERS
    source_id = tl.load(source_ids_ptr + pair).to(tl.int64)
    target_id = tl.load(target_ids_ptr + pair).to(tl.int64)
    source_start = kv * source_stride_kv + layer * source_stride_layer + source_id * source_stride_block
    target_start = kv * target_stride_kv + layer * target_stride_layer + target_id * target_stride_block
    offsets = tl.program_id(2).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offsets < BLOCK_ELEMENTS
    values = tl.load(source_ptr + source_start + offsets, mask=mask)
    tl.store(target_ptr + target_start + offsets, values, mask=mask)


def copy_blocks(source_pool: torch.Tensor, target_pool: torch.Tensor,
                source_ids: torch.Tensor, target_ids: torch.Tensor,
                tile: int = TILE, num_warps: int = NUM_WARPS) -> None:
    """target_pool[:, :, target_ids[p]] = source_pool[:, :, source_ids[p]] for every pair p.

    Pools [2, num_layers, num_blocks, *block] of one dtype and device, each block contiguous;
    the ids are 1-D integer tensors of equal length on that device. Queued on the current
    stream, not waited for. `tile` (a power of two) and `num_warps` are for
    bench/bench_block_copy.py's sweep; the defaults are what it chose."""
    if source_pool.dtype != target_pool.dtype or source_pool.shape[:2] != target_pool.shape[:2] \
            or source_pool.shape[3:] != target_pool.shape[3:]:
        raise ValueError(f"pools differ: {tuple(source_pool.shape)} {source_pool.dtype} against "
                         f"{tuple(target_pool.shape)} {target_pool.dtype}")
    block_elements = source_pool[0, 0, 0].numel()
    for pool in (source_pool, target_pool):
        if not pool[0, 0, 0].is_contiguous() or pool.stride(2) < block_elements:
            raise ValueError(f"a pool's blocks must be contiguous: strides {pool.stride()}")
    num_pairs = source_ids.numel()
    if num_pairs != target_ids.numel():
        raise ValueError(f"{num_pairs} source ids against {target_ids.numel()} target ids")
    if num_pairs == 0:
        return
    num_layers = source_pool.shape[1]
    grid = (num_pairs, 2 * num_layers, triton.cdiv(block_elements, tile))
    _copy_blocks_kernel[grid](
        source_pool, target_pool, source_ids, target_ids,
        source_pool.stride(0), source_pool.stride(1), source_pool.stride(2),
        target_pool.stride(0), target_pool.stride(1), target_pool.stride(2),
        NUM_LAYERS=num_layers, BLOCK_ELEMENTS=block_elements, TILE=tile, num_warps=num_warps,
    )

"""Split-KV for the paged attention kernels: when too few programs would fill the GPU, each
(query row, head) walks its keys in `num_splits` parts computed by separate programs, and a
second kernel merges their partial results.

A split writes, per (row, head), its unnormalized output (float32 [HEAD_DIM_PAD]) and its
running max and sum (exp2 domain) into scratch row (row * num_heads + head) * num_splits +
split; a split with nothing to see leaves max = -inf and sum = 0, which the merge weights to
zero, and a row whose splits all saw nothing gets a zero output. The split count is a launch
constant (part of a captured CUDA graph); each split derives its key range from the lengths
it reads at run time, so one count serves every context length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.inference.kernels.common import next_power_of_2

MAX_SPLITS = 16
# Every split count the kernels are launched with: the powers of two up to MAX_SPLITS (each is a
# compile-time variant, so start-up compiles them all: TritonAttention.warm_up).
SPLIT_COUNTS = tuple(1 << i for i in range(MAX_SPLITS.bit_length()))
WAVES = 2  # programs per SM the split count aims for


def splits_to_fill(num_programs: int, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits per program so that about WAVES waves of programs fill the GPU (1: no split)."""
    wanted = -(-WAVES * num_sms // max(1, num_programs))
    return max(1, min(max_splits, wanted))


def split_scratch(num_rows: int, num_heads: int, num_splits: int, head_dim: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs [rows * heads * splits, HEAD_DIM_PAD], (max, sum) [rows * heads * splits, 2]), float32."""
    num_partials = num_rows * num_heads * num_splits
    part_acc = torch.empty(num_partials, next_power_of_2(head_dim), dtype=torch.float32, device=device)
    part_stats = torch.empty(num_partials, 2, dtype=torch.float32, device=device)
    return part_acc, part_stats


@triton.jit
def store_partial(part_acc_ptr, part_stats_ptr, row, row_mask, d, acc, m_i, l_i, HEAD_DIM_PAD: tl.constexpr):
    """A split's (acc, m_i, l_i) for its query rows into their scratch rows `row` (int, [rows])."""
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_mask[:, None])
    tl.store(part_stats_ptr + row * 2, m_i, mask=row_mask)
    tl.store(part_stats_ptr + row * 2 + 1, l_i, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_stats_ptr, out_ptr, out_stride_t, out_stride_h,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    split_mask = s < NUM_SPLITS
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + s
    m = tl.load(part_stats_ptr + row * 2, mask=split_mask, other=float("-inf"))
    l = tl.load(part_stats_ptr + row * 2 + 1, mask=split_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    total = tl.sum(weight * l, 0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], mask=split_mask[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * out_stride_t + head * out_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def merge_splits(part_acc: torch.Tensor, part_stats: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """Every row of `out` [num_rows, num_heads, head_dim] from its splits' partial results."""
    num_rows, num_heads, head_dim = out.shape
    _merge_splits_kernel[(num_rows, num_heads)](
        part_acc, part_stats, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=part_acc.shape[1],
        num_warps=4,
    )

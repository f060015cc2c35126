"""W8A16 GEMM: out = (x @ dequant(w).T) + bias with int8 weights and 16-bit activations.

  x      [M, K]  activations in the model dtype (bfloat16/float16; float32 works, slowly);
  w      [N, K]  int8, symmetric: w_real[n, k] ~= w[n, k] * scale[n];
  scale  [N]     float32, one per output channel;
  bias   [N]     model dtype, optional.

Weight tiles are loaded as int8 (half the bytes of bfloat16: decode is bound by weight bytes)
and widened to the activation dtype in registers (exact: |w| <= 127 fits bfloat16's 8-bit
significand), the dot accumulates in float32, and the per-channel scale is applied once in the
epilogue, where it factors out of the sum over K: sum_k x[m,k] * w[n,k] * scale[n] =
scale[n] * sum_k x[m,k] * w[n,k].

Launch configuration comes from `w8a16_config(M, N, K, num_sms)`, a fixed heuristic (no
autotuning at call time, so a call inside CUDA-graph capture launches what an eager call would):
  M <= 128 (decode): BLOCK_M covers M (>= 16, tl.dot's minimum) and BLOCK_N = 128 channels;
      split-K when the output tiles alone would leave SMs idle: each split writes float32
      partials [SPLIT_K, M, N] and a second small kernel sums them in a fixed order, adds the
      bias and casts. Deterministic (no atomics) and capturable (no host sync, no memset).
  larger M (prefill): 256 x 128 tiles computed as out.T = w @ x.T (SWAP_AB), grouped launch
      order so GROUP_M row blocks reuse each weight column block from L2.
The measurements behind the choices are next to _CONFIGS. The weight codes may also be float8
e4m3 (exact in bfloat16 too): the same kernel is then an FP8 weight-only GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.inference.kernels.common import dot_is_ieee

MAX_SPLIT_K = 8
WAVES = 2  # split-K aims for this many programs per SM


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, x_stride, out_stride, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: consecutive programs walk GROUP_M row blocks down one weight column block.
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns read a valid row instead (wrapped) and are masked at the store:
    # the main loop then needs no M/N masks.
    rm_load = (rm % M).to(tl.int64)
    rn_load = (rn % N).to(tl.int64)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if SWAP_AB:
        # out.T = w @ x.T: the widened weight tile is the dot's first operand, which Hopper's
        # wgmma reads from registers (the second must sit in shared memory), and the token
        # count becomes the dot's N (wgmma allows 8..256) rather than a padded M.
        w_ptrs = w_ptr + rn_load[:, None] * K + (k_start + rk)[None, :]  # [BLOCK_N, BLOCK_K]
        x_ptrs = x_ptr + rm_load[None, :] * x_stride + (k_start + rk)[:, None]  # [BLOCK_K, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        x_ptrs = x_ptr + rm_load[:, None] * x_stride + (k_start + rk)[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + rn_load[None, :] * K + (k_start + rk)[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        elif SWAP_AB:
            k_mask = k + rk < k_end
            x = tl.load(x_ptrs, mask=k_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        else:
            k_mask = k + rk < k_end
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        w = w.to(x.dtype)
        if SWAP_AB:
            acc = _dot(w, x, acc, IEEE)
        else:
            acc = _dot(x, w, acc, IEEE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    _store_tile(acc, rm, rn, split, scale_ptr, bias_ptr, out_ptr, M, N, out_stride, SPLIT_K, HAS_BIAS)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _store_tile(acc, rm, rn, split, scale_ptr, bias_ptr, out_ptr, M, N, out_stride, SPLIT_K: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """acc [rows rm, columns rn] float32 sums of codes x activations: apply the channel scale,
    then the bias and store in the output dtype, or (split-K) store float32 partials."""
    n_mask = rn < N
    acc = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    out_mask = (rm < M)[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rm[:, None].to(tl.int64) * out_stride + rn[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # out_ptr is the float32 partials buffer [SPLIT_K, M, N]
        part_ptrs = out_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(part_ptrs, acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_elements"])
def _sum_splits_kernel(
    part_ptr, bias_ptr, out_ptr, num_elements, N, out_stride,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    total = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(part_ptr + split * num_elements + offsets, mask=mask, other=0.0)
    row = offsets // N
    col = offsets % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + col, total.to(out_ptr.dtype.element_ty), mask=mask)


# Tile configurations, swept on an H200 over Llama-3-8B's four projection shapes (N x K =
# 6144x4096, 4096x4096, 28672x4096, 4096x14336), bfloat16 activations, timed as CUDA-graph
# replays over 8 distinct weights (no L2 reuse). Per-layer sums of the four, in us, for these
# defaults against bf16 cuBLAS (F.linear) and fp8 W8A8 (per-token quant + torch._scaled_mm):
#     M      1      4     16     32     64    128    256   1024   4096   8192
#   int8   89.7   83.8   84.2  102.5  124.8  175.1  273.8    880   3292   6649
#   bf16  117.8  118.7  120.4  122.6  126.3  134.5  178.1    595   2677   5301
#   fp8   138.1  140.6  134.9  131.1  126.1  119.5  144.7    395   1682   3340
# Weight-only int8 halves the bytes but not the multiply-adds: on an H200 a GEMM with int8
# weights is bound by tensor-core rate from M ~ 100 on (bf16 weights: M ~ 200), and widening in
# registers costs throughput, so past M ~ 64 this kernel is slower than a bf16 GEMM. fp8 W8A8
# is the method for large batches and prefill. Rows: (max M, config); the first row with
# max M >= M applies.
_CONFIGS = (
    (16, dict(block_m=16, block_n=128, block_k=256, num_warps=4, num_stages=3)),
    (32, dict(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4)),
    (64, dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)),
    (None, dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)),
)
# Large grids (prefill; M > 128 with two waves of 128x128 tiles): 256-token x 128-channel tiles
# with the weight as the dot's register operand; 1.2-1.3x faster than the 128x128 tile there.
LARGE_CONFIG = dict(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=4, swap_ab=True)
LARGE_CONFIG_FLOAT32 = LARGE_CONFIG | {"num_stages": 2}  # 4-byte x tiles: 4 stages overflow 227 KiB of smem
LARGE_MIN_M = 512  # from here the large tile wins whatever the grid
GROUP_M = 8
MIN_K_PER_SPLIT = 1024  # a split streams >= 128 KiB of weights per program (BLOCK_N=128 int8)


def w8a16_config(M: int, N: int, K: int, num_sms: int, activation_bytes: int = 2) -> dict:
    """Launch configuration for an [M, K] x [N, K]^T product: tiles by M, then the largest
    power-of-2 split-K factor (<= MAX_SPLIT_K) that keeps the program count within WAVES x
    num_sms and each split at least MIN_K_PER_SPLIT deep. At M <= 64 this picks, for every
    8B shape, the best of the splits swept (o_proj at M=1: 4 splits, 11.4 us; 8: 13.1 us)."""
    config = dict(_tile_config(M, N, num_sms, activation_bytes))
    num_tiles = triton.cdiv(M, config["block_m"]) * triton.cdiv(N, config["block_n"])
    split_k = 1
    while (
        split_k * 2 <= MAX_SPLIT_K
        and num_tiles * split_k * 2 <= WAVES * num_sms
        and K >= split_k * 2 * MIN_K_PER_SPLIT
    ):
        split_k *= 2
    config["split_k"] = split_k
    return config


def _tile_config(M: int, N: int, num_sms: int, activation_bytes: int) -> dict:
    num_large_tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    if M >= LARGE_MIN_M or (M > 128 and num_large_tiles >= WAVES * num_sms):
        return LARGE_CONFIG if activation_bytes <= 2 else LARGE_CONFIG_FLOAT32
    return next(c for max_m, c in _CONFIGS if max_m is None or M <= max_m)


def w8a16_matmul(
    x: torch.Tensor,  # [M, K], unit stride on K
    weight: torch.Tensor,  # [N, K] int8 (or float8_e4m3fn), contiguous
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N] or None
    num_sms: int,
    config: dict | None = None,
) -> torch.Tensor:
    """[M, N] in x's dtype: x @ (weight * scale[:, None]).T + bias."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and weight.dtype in (torch.int8, torch.float8_e4m3fn) and weight.is_contiguous()
    assert x.stride(-1) == 1 and scale.dtype == torch.float32
    if config is None:
        config = w8a16_config(M, N, K, num_sms, x.element_size())
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    split_k = config["split_k"]
    block_k = config["block_k"]
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    target = out if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, config["block_m"]) * triton.cdiv(N, config["block_n"]), split_k)
    _w8a16_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, target,  # bias unread without HAS_BIAS
        M, N, K, x.stride(0), out.stride(0), k_per_split,
        BLOCK_M=config["block_m"], BLOCK_N=config["block_n"], BLOCK_K=block_k, GROUP_M=GROUP_M,
        SPLIT_K=split_k, EVEN_K=K % (split_k * block_k) == 0, HAS_BIAS=bias is not None,
        IEEE=dot_is_ieee(x.dtype), SWAP_AB=config.get("swap_ab", False),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](
            target, bias if bias is not None else scale, out, M * N, N, out.stride(0),
            SPLIT_K=split_k, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4,
        )
    return out

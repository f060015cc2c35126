"""Triton kernels against float64 torch references.

On CPU the kernels run under Triton's interpreter (tests/triton_cpu.py) in float32; on CUDA the
same tests run the compiled kernels in float32 and bfloat16. Skipped where triton is missing.
Inputs are fresh random values for every case; outputs are poisoned first (NaN), so a row the
kernel forgets to write fails the comparison.
"""

from __future__ import annotations

from tests.triton_cpu import HAS_CUDA, HAS_TRITON, KERNEL_DEVICE  # noqa: I001  (before any kernel import)

import pytest
import torch

from llmserve.inference.models.layers import RMSNorm
from llmserve.inference.models.rope import apply_rope
from tests.tensor_checks import rel_error

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

DTYPES = [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32]
# ||out - ref|| / ||ref||: float32 arithmetic; bfloat16 operands and outputs.
REL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
BLOCK_SIZE = 16


def random_cache(num_blocks, num_kv_heads, head_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=generator).to(KERNEL_DEVICE, dtype)
    v = torch.randn(shape, generator=generator).to(KERNEL_DEVICE, dtype)
    return k, v


def random_tables(num_seqs, max_blocks, num_blocks, seed) -> torch.Tensor:
    """Distinct shuffled blocks per sequence, so a wrong block index reads someone else's K/V."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=generator)[: num_seqs * max_blocks]
    return order.view(num_seqs, max_blocks).to(KERNEL_DEVICE, torch.int32)


def reference_attention(q, k_cache, v_cache, table, context_len, query_positions, scale, window):
    """q [n, heads, dim] at `query_positions` over the first `context_len` cached tokens, float64."""
    positions = torch.arange(context_len, device=q.device)
    slots = table.long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
    v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = positions[None, :] <= query_positions[:, None]
    if window is not None:
        visible &= positions[None, :] > query_positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 32), (12, 2, 80)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim, num_splits, window):
    from llmserve.inference.kernels.paged_decode import paged_decode_attention

    context_lens = [1, 37, 0, 150]  # 0: a padding row of a graph bucket -> zeros
    k_cache, v_cache = random_cache(48, num_kv_heads, head_dim, dtype, seed=num_heads + head_dim)
    tables = random_tables(len(context_lens), 10, 48, seed=num_splits)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    q = q.to(KERNEL_DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32, device=KERNEL_DEVICE),
        head_dim**-0.5, num_splits=num_splits, sliding_window=window, out=out,
    )
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for i, context_len in enumerate(context_lens):
        if context_len == 0:
            continue
        position = torch.tensor([context_len - 1], device=KERNEL_DEVICE)
        ref = reference_attention(q[i : i + 1], k_cache, v_cache, tables[i], context_len, position, head_dim**-0.5, window)
        assert rel_error(out[i : i + 1], ref) < REL_TOLERANCE[dtype], (i, context_len)


def test_paged_decode_reads_a_float8_cache():
    """float8 e4m3 K/V (scale 1) are widened after loading: the result equals attention over the
    float8 values themselves (the quantization error is the cache's, not the kernel's)."""
    from llmserve.inference.kernels.paged_decode import paged_decode_attention

    context_lens = [19, 70]
    k_cache, v_cache = random_cache(16, 2, 64, torch.float32, seed=13)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    tables = random_tables(2, 5, 16, seed=14)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(15)).to(KERNEL_DEVICE, dtype)
    out = paged_decode_attention(q, k8, v8, tables, torch.tensor(context_lens, dtype=torch.int32, device=KERNEL_DEVICE),
                                 0.125, num_splits=2)
    for i, context_len in enumerate(context_lens):
        position = torch.tensor([context_len - 1], device=KERNEL_DEVICE)
        ref = reference_attention(q[i : i + 1], k8.float(), v8.float(), tables[i], context_len, position, 0.125, None)
        assert rel_error(out[i : i + 1], ref) < REL_TOLERANCE[dtype]


def test_rope_and_write_kv_saturates_a_float8_cache():
    from llmserve.inference.kernels.rope_kv import FP8_E4M3_MAX, rope_and_write_kv

    k = torch.tensor([[[1000.0, -3.0, 0.5, -1000.0]]], device=KERNEL_DEVICE)  # 1 token, 1 head, dim 4
    v = torch.tensor([[[-900.0, 2.0, 448.0, 7.0]]], device=KERNEL_DEVICE)
    zeros = torch.zeros(1, 2, device=KERNEL_DEVICE)  # angle 0: cos 1, sin 0
    k_cache = torch.zeros(1, BLOCK_SIZE, 1, 4, dtype=torch.float8_e4m3fn, device=KERNEL_DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5], dtype=torch.int32, device=KERNEL_DEVICE)
    rope_and_write_kv(k.clone(), k, v, zeros + 1, zeros, k_cache, v_cache, slots)
    assert k_cache[0, 5, 0].float().tolist() == [FP8_E4M3_MAX, -3.0, 0.5, -FP8_E4M3_MAX]
    assert v_cache[0, 5, 0].float().tolist() == [-FP8_E4M3_MAX, 2.0, 448.0, 7.0]


def run_paged_prefill(q, k_cache, v_cache, tables, chunks, first_row, window, num_splits, max_query_len=None):
    """The chunks [(query_len, context_len)] back to back from row `first_row` of q; `out` poisoned."""
    from llmserve.inference.kernels.paged_prefill import paged_prefill_attention

    starts = [first_row + sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    out = torch.full_like(q, float("nan"))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=KERNEL_DEVICE)  # noqa: E731
    head_dim = q.shape[-1]
    paged_prefill_attention(
        q, k_cache, v_cache, tables, as_tensor(starts), as_tensor([n for n, _ in chunks]),
        as_tensor([c for _, c in chunks]), max_query_len or max(n for n, _ in chunks), head_dim**-0.5,
        sliding_window=window, out=out, num_splits=num_splits, first_row=first_row,
    )
    return out, starts


def assert_prefill_matches_reference(out, starts, q, k_cache, v_cache, tables, chunks, window, dtype):
    head_dim = q.shape[-1]
    for i, (query_len, context_len) in enumerate(chunks):
        rows = slice(starts[i], starts[i] + query_len)
        positions = torch.arange(context_len - query_len, context_len, device=KERNEL_DEVICE)
        ref = reference_attention(q[rows], k_cache, v_cache, tables[i], context_len, positions, head_dim**-0.5, window)
        assert rel_error(out[rows], ref) < REL_TOLERANCE[dtype], i


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_prefill_matches_reference(dtype, num_heads, num_kv_heads, head_dim, window, num_splits):
    # (query_len, context_len): a chunk after a cached prefix, a fresh prompt, one over a tile,
    # and a short chunk after a long prefix (3 splits of 128, 128 and 44 keys).
    chunks = [(20, 50), (33, 33), (70, 90), (16, 300)]
    k_cache, v_cache = random_cache(96, num_kv_heads, head_dim, dtype, seed=7)
    tables = random_tables(len(chunks), 19, 96, seed=8)
    first_row = 5  # 5 rows before the chunks (decodes) must stay untouched
    num_rows = first_row + sum(n for n, _ in chunks)
    q = torch.randn(num_rows, num_heads, head_dim, generator=torch.Generator().manual_seed(9)).to(KERNEL_DEVICE, dtype)
    out, starts = run_paged_prefill(q, k_cache, v_cache, tables, chunks, first_row, window, num_splits)
    assert_prefill_matches_reference(out, starts, q, k_cache, v_cache, tables, chunks, window, dtype)
    assert torch.isnan(out[:first_row]).all()


def test_paged_prefill_splits_over_a_padded_graph_grid():
    """A prefill graph's launch: one chunk of 20 rows over 180 cached tokens in a grid sized for
    64 rows (max_query_len = the padded size), 4 splits; the padding rows' tiles do no work."""
    chunks = [(20, 200)]
    k_cache, v_cache = random_cache(16, 2, 32, torch.float32, seed=21)
    tables = random_tables(1, 13, 16, seed=22)
    q = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(23)).to(KERNEL_DEVICE)
    out, starts = run_paged_prefill(q, k_cache, v_cache, tables, chunks, 0, None, num_splits=4, max_query_len=64)
    assert_prefill_matches_reference(out, starts, q, k_cache, v_cache, tables, chunks, None, torch.float32)


def test_paged_prefill_splits_read_a_float8_cache_and_leave_splits_with_no_keys_empty():
    """float8 K/V, and 5 splits over contexts where some splits have no key (a 40-token fresh
    prompt) or see only keys outside the window: the merge weights those to zero."""
    chunks = [(40, 40), (24, 200)]
    k_cache, v_cache = random_cache(32, 2, 64, torch.float32, seed=17)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    tables = random_tables(len(chunks), 13, 32, seed=18)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    q = torch.randn(64, 8, 64, generator=torch.Generator().manual_seed(19)).to(KERNEL_DEVICE, dtype)
    for window in (None, 30):
        out, starts = run_paged_prefill(q, k8, v8, tables, chunks, 0, window, num_splits=5)
        assert_prefill_matches_reference(out, starts, q, k8.float(), v8.float(), tables, chunks, window, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_write_kv(dtype):
    from llmserve.inference.kernels.rope_kv import rope_and_write_kv

    num_tokens, num_heads, num_kv_heads, head_dim = 6, 8, 2, 64
    generator = torch.Generator().manual_seed(11)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(KERNEL_DEVICE, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))  # strided views, as in the model
    positions = torch.tensor([0, 5, 17, 300, 2, 9], device=KERNEL_DEVICE).float()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=KERNEL_DEVICE).float() / head_dim)
    freqs = positions[:, None] * inv_freq[None, :]
    k_cache = torch.full((4, BLOCK_SIZE, num_kv_heads, head_dim), 7.0, dtype=dtype, device=KERNEL_DEVICE)
    v_cache = k_cache.clone()
    slots = torch.tensor([3, 17, -1, 40, 0, 63], dtype=torch.int32, device=KERNEL_DEVICE)  # -1: padding

    q_out = rope_and_write_kv(q, k, v, freqs.cos(), freqs.sin(), k_cache, v_cache, slots)

    cos, sin = torch.cat((freqs, freqs), -1).cos().double(), torch.cat((freqs, freqs), -1).sin().double()
    assert rel_error(q_out, apply_rope(q.double(), cos, sin)) < REL_TOLERANCE[dtype]
    k_ref = apply_rope(k.double(), cos, sin)
    k_slots, v_slots = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert rel_error(k_slots[slot], k_ref[token]) < REL_TOLERANCE[dtype]
            assert torch.equal(v_slots[slot], v[token])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(k_slots.shape[0]) if s not in written]
    assert (k_slots[untouched] == 7.0).all() and (v_slots[untouched] == 7.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 2048])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    from llmserve.inference.kernels.rms_norm import rms_norm

    generator = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(5, hidden, generator=generator).to(KERNEL_DEVICE, dtype) for _ in range(2))
    norm = RMSNorm(hidden, 1e-5).to(KERNEL_DEVICE, dtype)
    norm.weight.data = torch.randn(hidden, generator=generator).to(KERNEL_DEVICE, dtype)

    out, new_residual = rms_norm(x, norm.weight, norm.eps, residual)
    assert new_residual.dtype == torch.float32  # the residual stream is never rounded
    assert torch.equal(new_residual, x.float() + residual.float())
    # The portable path rounds x + residual to the model dtype first; float32 sums may differ in order only.
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out, norm(x + residual), rtol=tolerance, atol=tolerance)
    out_again, _ = rms_norm(x, norm.weight, norm.eps, new_residual)  # a float32 residual in
    torch.testing.assert_close(out_again, norm((x.float() * 2 + residual.float()).to(dtype)), rtol=tolerance, atol=tolerance)
    out_alone, none = rms_norm(x, norm.weight, norm.eps)
    assert none is None
    torch.testing.assert_close(out_alone, norm(x), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_rms_norm_takes_a_float32_input_and_answers_in_the_weight_dtype():
    """o_proj/down_proj write float32 on the triton backend: the norm after them adds in float32,
    rounds the normalized value to the model dtype (the weight's) as LlamaRMSNorm does, and
    returns that dtype for the next GEMM."""
    from llmserve.inference.kernels.rms_norm import rms_norm

    generator = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(3, 96, generator=generator).to(KERNEL_DEVICE) for _ in range(2))
    weight = torch.randn(96, generator=generator).to(KERNEL_DEVICE, torch.bfloat16)
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == torch.bfloat16 and new_residual.dtype == torch.float32
    total = x + residual
    normed = (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    expected = (weight.float() * normed.float()).to(torch.bfloat16)
    # Two roundings to bf16: up to one step (2^-7 relative) each, whatever the rounding mode.
    torch.testing.assert_close(out.float(), expected.float(), rtol=1.6e-2, atol=1e-6)
    assert torch.equal(new_residual, total)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_float32_output_linear_skips_the_bf16_rounding():
    from llmserve.inference.models.triton_ops import float32_output_linear

    generator = torch.Generator().manual_seed(8)
    linear = torch.nn.Linear(256, 384, bias=True).to("cuda", torch.bfloat16)
    x = torch.randn(5, 256, generator=generator).to("cuda", torch.bfloat16)
    reference = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    out = float32_output_linear(linear, x)
    assert out.dtype == torch.float32
    error = (out.double() - reference).norm() / reference.norm()
    error_bf16 = (linear(x).double() - reference).norm() / reference.norm()
    assert error < 1e-4 < error_bf16  # float32 accumulation only vs. one bf16 rounding (~2e-3)
    cpu_linear = torch.nn.Linear(4, 4)
    assert float32_output_linear(cpu_linear, torch.ones(1, 4)).dtype == torch.float32  # plain linear(x) off CUDA


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    from llmserve.inference.kernels.activation import silu_and_mul

    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(5)).to(KERNEL_DEVICE, dtype)
    ref = torch.nn.functional.silu(gate_up[:, :1500].double()) * gate_up[:, 1500:].double()
    assert rel_error(silu_and_mul(gate_up), ref) < REL_TOLERANCE[dtype] / 2


@pytest.mark.parametrize("dtype", [*DTYPES, torch.uint8])  # uint8: a float8 pool, copied as bytes
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 16), (3, 40)])  # 40: a tile the block does not fill
def test_copy_blocks_between_pools_of_different_sizes(dtype, num_kv_heads, head_dim):
    from llmserve.inference.kernels.block_copy import copy_blocks

    num_layers, generator = 3, torch.Generator().manual_seed(head_dim)
    block = (BLOCK_SIZE, num_kv_heads, head_dim)
    source = torch.randint(0, 250, (2, num_layers, 11, *block), generator=generator).to(KERNEL_DEVICE, dtype)
    target = torch.full((2, num_layers, 17, *block), 255, dtype=dtype, device=KERNEL_DEVICE)
    source_ids = torch.tensor([7, 0, 3, 10, 4], device=KERNEL_DEVICE)  # no runs: the pull's gather case
    target_ids = torch.tensor([16, 2, 9, 1, 5], device=KERNEL_DEVICE)
    copy_blocks(source, target, source_ids, target_ids)
    expected = torch.full_like(target, 255)
    expected[:, :, target_ids] = source[:, :, source_ids]
    assert torch.equal(target, expected)  # the copied blocks, and every other block untouched


def test_copy_blocks_refuses_pools_that_differ():
    from llmserve.inference.kernels.block_copy import copy_blocks

    source = torch.zeros(2, 2, 4, BLOCK_SIZE, 2, 8, device=KERNEL_DEVICE)
    ids = torch.tensor([0], device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="pools differ"):
        copy_blocks(source, torch.zeros(2, 2, 4, BLOCK_SIZE, 2, 16, device=KERNEL_DEVICE), ids, ids)
    with pytest.raises(ValueError, match="source ids"):
        copy_blocks(source, source.clone(), ids, torch.tensor([0, 1], device=KERNEL_DEVICE))

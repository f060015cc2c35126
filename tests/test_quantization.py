"""Weight quantization (models/quant_codes.py, models/quantization.py) and its kernels (fp8_quant,
w8a16_matmul).

CPU: pack/unpack round trips against their error bounds, the reference forward of each module
against F.linear on the dequantized weights (tight) and on the original weights (loose, the
quantization error), and quantize_linears on tiny real models. The Triton kernels run under the
interpreter (tests/triton_cpu.py) when triton is importable, compiled on CUDA. The `gpu` tests
run the CUDA paths of both modules (Triton W8A16 GEMM; per-token fp8 kernel + torch._scaled_mm)
against the reference in bfloat16, eagerly and inside a CUDA graph.

Error measure: ||out - ref|| / ||ref|| over the whole output (rel_error).
"""

from __future__ import annotations

from tests.triton_cpu import HAS_CUDA, HAS_TRITON, KERNEL_DEVICE  # noqa: I001  (before any kernel import)

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmserve.inference.models.step_inputs import StepInputs
from llmserve.inference.models.attention_backend import create_attention_backend
from llmserve.inference.models.decoder_config import DecoderConfig
from llmserve.inference.models.layers import MergedLinear
from llmserve.inference.models.loader import load_model
from llmserve.inference.models.quant_codes import (
    FP8_E4M3_MAX,
    dequantize,
    quantize_per_token_fp8,
    quantize_weight_fp8,
    quantize_weight_int8,
)
from llmserve.inference.models.quantization import QUANTIZED_LINEAR_NAMES, Fp8Linear, Int8Linear, quantize_linears
from tests.tensor_checks import rel_error

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
E4M3_RELATIVE_STEP = 2.0**-4  # half the spacing of 3 mantissa bits, relative to the value
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # half the subnormal spacing 2^-9 (in units of the scale)
FLOAT32_SLACK = 1e-6  # relative to |w|: float32 rounding of scale (and code * scale) on top of the bound


def random_weight(num_rows: int, num_cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows of very different magnitudes (1e-3 .. 10, as real channels have), one all-zero row."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.empty(num_rows, 1).uniform_(-3, 1, generator=generator)
    weight = torch.randn(num_rows, num_cols, generator=generator) * magnitudes
    weight[num_rows // 2] = 0.0
    return weight.to(dtype)


def random_linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.05)
        if bias:
            linear.bias.normal_(0.0, 0.05)
    return linear


# --- pack / unpack ------------------------------------------------------------------------------


def assert_per_row_codes(weight, codes, scales, code_dtype: torch.dtype, code_max: float) -> None:
    """`weight` (from random_weight: its middle row zero) quantized per output row: codes of
    `code_dtype` in its shape, one float32 scale a row, and each other row spanning the full
    range (its largest code is +-code_max)."""
    num_rows = weight.shape[0]
    assert codes.dtype == code_dtype and codes.shape == weight.shape
    assert scales.dtype == torch.float32 and scales.shape == (num_rows,)
    nonzero = torch.arange(num_rows) != num_rows // 2
    assert (codes[nonzero].float().abs().amax(dim=1) == code_max).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_is_within_half_a_step(dtype):
    weight = random_weight(48, 80, seed=1, dtype=dtype)
    codes, scales = quantize_weight_int8(weight)
    assert_per_row_codes(weight, codes, scales, torch.int8, 127)
    assert codes.abs().max() <= 127  # symmetric: -128 is never used
    error = (weight.float() - dequantize(codes, scales)).abs()
    assert (error <= scales[:, None] / 2 + FLOAT32_SLACK * weight.float().abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_is_within_e4m3_precision(dtype):
    weight = random_weight(48, 80, seed=2, dtype=dtype)
    codes, scales = quantize_weight_fp8(weight)
    assert_per_row_codes(weight, codes, scales, torch.float8_e4m3fn, FP8_E4M3_MAX)
    restored = dequantize(codes, scales)
    assert torch.isfinite(restored).all()
    error = (weight.float() - restored).abs()
    bound = E4M3_RELATIVE_STEP * weight.float().abs() + E4M3_SUBNORMAL_HALF_STEP * scales[:, None]
    assert (error <= bound + FLOAT32_SLACK * weight.float().abs()).all()


@pytest.mark.parametrize("quantize", [quantize_weight_int8, quantize_weight_fp8])
def test_zero_rows_get_scale_one_and_zero_codes(quantize):
    weight = torch.zeros(3, 16)
    weight[1, 5] = -2.0
    codes, scales = quantize(weight)
    assert scales[0] == 1.0 and scales[2] == 1.0
    assert (codes[0].float() == 0).all() and (codes[2].float() == 0).all()
    assert torch.equal(dequantize(codes, scales), weight)  # -2 is the row's amax: exact


def test_per_token_fp8_scales_each_row_to_448():
    row_magnitudes = torch.tensor([[0.01], [1.0], [0.0], [50.0], [3.0]])  # row 2: all zeros
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * row_magnitudes
    codes, scales = quantize_per_token_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (5, 1) and scales.dtype == torch.float32
    expected = x.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX
    expected[2] = 1.0
    torch.testing.assert_close(scales, expected, rtol=2**-23, atol=0)  # times 1/448 in float32: last bit
    restored = dequantize(codes, scales)
    bound = E4M3_RELATIVE_STEP * x.abs() + E4M3_SUBNORMAL_HALF_STEP * scales
    assert ((x - restored).abs() <= bound + FLOAT32_SLACK * x.abs()).all()


# --- module reference forwards -----------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_reference_matches_f_linear_on_dequantized_weights(bias):
    linear = random_linear(96, 64, bias, seed=4)
    module = Int8Linear.from_linear(linear)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(5))
    expected = F.linear(x, dequantize(module.weight, module.weight_scale), linear.bias)
    assert torch.equal(module(x), expected)
    # Against the unquantized layer: weight error uniform in +-scale/2, scale = amax/127 (~3.3
    # sigma / 127 for Gaussian rows), so ~0.008 relative rms; 0.02 leaves room for the seed.
    assert rel_error(module(x), linear(x)) < 0.02


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_reference_is_w8a8_emulated_in_float32(bias):
    linear = random_linear(96, 64, bias, seed=6)
    module = Fp8Linear.from_linear(linear)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(7))
    x_codes, x_scales = quantize_per_token_fp8(x)
    # What the float8 tensor cores compute: exact products of codes, summed, then both scales.
    expected = (x_codes.double() @ module.weight.double().T) * x_scales.double() * module.weight_scale.double()
    if bias:
        expected += linear.bias.double()
    assert rel_error(module(x), expected) < 1e-6
    # Against the unquantized layer: e4m3 rounds each operand by up to 2^-4 relative (~2.4%
    # rms for values spread over binades), both operands: ~3-4% expected; bound 0.08.
    assert rel_error(module(x), linear(x)) < 0.08


@pytest.mark.parametrize("module_cls", [Int8Linear, Fp8Linear])
def test_modules_keep_leading_dims_dtype_and_empty_batches(module_cls):
    module = module_cls.from_linear(random_linear(32, 48, True, seed=8))
    x = torch.randn(2, 3, 32)
    out = module(x)
    assert out.shape == (2, 3, 48) and out.dtype == torch.float32
    # Rows are independent (per-token scales; a per-tensor scale would move this far more).
    torch.testing.assert_close(out[1, 2], module(x[1, 2][None])[0], rtol=1e-5, atol=1e-6)
    assert module(torch.randn(0, 32)).shape == (0, 48)
    bf16_module = module_cls.from_linear(random_linear(32, 48, True, seed=8).to(torch.bfloat16))
    assert bf16_module(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_weight_bytes_count_codes_scales_and_bias():
    linear = random_linear(64, 48, True, seed=9)
    for module_cls in (Int8Linear, Fp8Linear):
        module = module_cls.from_linear(linear)
        assert module.weight_bytes == 48 * 64 * 1 + 48 * 4 + 48 * 4  # codes + float32 scales + float32 bias


def test_fp8_rejects_shapes_scaled_mm_cannot_run():
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear.from_linear(nn.Linear(40, 64))
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear.from_linear(nn.Linear(64, 24))
    Int8Linear.from_linear(nn.Linear(40, 24))  # no alignment rule


# --- quantize_linears on tiny real models ------------------------------------------------------


BLOCK_SIZE = 16


def load_tiny(model_dir, device="cpu", dtype=torch.float32):
    """A tiny model on the portable attention backend (the reference numerics on any device)."""
    config = DecoderConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    attention = create_attention_backend("portable", config, BLOCK_SIZE, torch.device(device))
    return load_model(model_dir, config, torch.device(device), dtype, attention)


@torch.inference_mode()
def prefill_logits(model, num_tokens: int = 40) -> torch.Tensor:
    """float32 logits [num_tokens, vocab] of one fresh prompt in one prefill chunk."""
    config = model.config
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    token_ids = torch.randint(3, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                 for _ in range(config.num_layers)]
    step = StepInputs(
        input_ids=token_ids.tolist(), positions=list(range(num_tokens)), slot_mapping=list(range(num_tokens)),
        prefill_query_starts=[0], prefill_query_lens=[num_tokens], prefill_context_lens=[num_tokens],
        prefill_block_tables=[list(range(num_blocks))], prefill_has_cached_prefix=[False],
    )
    positions = torch.arange(num_tokens, device=device)
    hidden = model(token_ids.to(device), positions, kv_caches, model.attention.build_metadata(step))
    return model.compute_logits(hidden)


# Relative logit error measured on these tiny random models (2 layers, 64 wide, weights
# N(0, 0.08)), 40-token prompt, float32: int8 0.016 (llama) .. 0.022 (qwen2/3), fp8 0.093 ..
# 0.121. Each linear alone is off by ~0.6% (int8) / ~3.5% (fp8) on these activations (the
# module tests above); 8 linears in sequence and two attention softmaxes of a random model
# compound that ~3x. Bounds ~2x the worst seen; a wrong scale or a broken q/k/v split is ~100%.
MODEL_LOGIT_BOUNDS = {"int8": 0.045, "fp8": 0.25}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantize_linears_swaps_every_decoder_linear(tiny_model_dirs, arch, method):
    model = load_tiny(tiny_model_dirs[arch])
    reference_logits = prefill_logits(model)
    output_sizes = [layer.self_attn.qkv_proj.output_sizes for layer in model.model.layers]
    lm_head, embed = model.lm_head, model.model.embed_tokens

    quantize_linears(model, method)

    module_cls = {"int8": Int8Linear, "fp8": Fp8Linear}[method]
    for i, layer in enumerate(model.model.layers):
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        assert all(isinstance(linear, module_cls) for linear in linears)
        assert layer.self_attn.qkv_proj.output_sizes == output_sizes[i]
        assert layer.mlp.gate_up_proj.output_sizes == [model.config.intermediate_size] * 2
        assert (layer.self_attn.qkv_proj.bias is not None) == (arch == "qwen2")
    assert not any(isinstance(m, (nn.Linear, MergedLinear)) and name.rpartition(".")[2] in QUANTIZED_LINEAR_NAMES
                   for name, m in model.named_modules())
    assert model.lm_head is lm_head and model.model.embed_tokens is embed
    assert model.lm_head.weight.dtype == torch.float32  # lm_head and embeddings stay unquantized

    error = rel_error(prefill_logits(model), reference_logits)
    print(f"{arch} {method}: relative logit error {error:.4f}")
    assert error < MODEL_LOGIT_BOUNDS[method]


def test_quantize_linears_none_and_unknown(tiny_model_dir):
    model = load_tiny(tiny_model_dir)
    modules_before = list(model.modules())
    quantize_linears(model, "none")
    assert list(model.modules()) == modules_before
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_linears(model, "int4")


def test_quantize_linears_checks_every_layer_before_swapping(tiny_model_dir):
    model = load_tiny(tiny_model_dir)
    model.model.layers[1].mlp.down_proj = nn.Linear(128, 40)  # N=40: not a multiple of 16
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: fp8 needs"):
        quantize_linears(model, "fp8")
    assert type(model.model.layers[0].self_attn.qkv_proj) is MergedLinear  # nothing swapped


# --- Triton kernels (interpreter on CPU, compiled on CUDA) -------------------------------------


def w8a16_reference(x, codes, scales, bias) -> torch.Tensor:
    out = x.double() @ dequantize(codes, scales).double().T
    return out + bias.double() if bias is not None else out


SMALL_TILES = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
VARIANTS = {"dot": {}, "swap_ab": {"swap_ab": True}}


@needs_triton
@pytest.mark.parametrize(
    ("M", "N", "K", "split_k"),
    [(1, 48, 64, 1), (1, 80, 200, 3), (5, 80, 200, 1), (33, 64, 96, 1), (5, 80, 200, 3), (3, 40, 256, 4),
     (17, 64, 256, 2)],
)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_matmul_matches_reference(M, N, K, split_k, variant, bias):
    """Tiles that do not divide M, N or K; split-K with even and uneven K ranges (K=200 in 3
    splits of 96 leaves the last split 8 columns, K=256 in 4 is even); both operand orders."""
    from llmserve.inference.kernels.w8a16_matmul import w8a16_matmul

    generator = torch.Generator().manual_seed(M * 1000 + N + K + split_k)
    codes, scales = quantize_weight_int8(torch.randn(N, K, generator=generator))
    x = torch.randn(M, K, generator=generator)
    bias_tensor = torch.randn(N, generator=generator) if bias else None
    codes, scales, x = codes.to(KERNEL_DEVICE), scales.to(KERNEL_DEVICE), x.to(KERNEL_DEVICE)
    bias_tensor = bias_tensor.to(KERNEL_DEVICE) if bias else None
    config = SMALL_TILES | VARIANTS[variant] | {"split_k": split_k}
    out = w8a16_matmul(x, codes, scales, bias_tensor, num_sms=4, config=config)
    assert out.shape == (M, N) and out.dtype == torch.float32
    assert rel_error(out, w8a16_reference(x, codes, scales, bias_tensor)) < 1e-5


@needs_triton
@pytest.mark.parametrize("variant", VARIANTS)
def test_w8a16_matmul_takes_float8_codes(variant):
    """e4m3 codes widen exactly like int8 ones: the same kernel serves fp8 weights (W8A16)."""
    from llmserve.inference.kernels.w8a16_matmul import w8a16_matmul

    generator = torch.Generator().manual_seed(21)
    codes, scales = quantize_weight_fp8(torch.randn(48, 96, generator=generator))
    x = torch.randn(1, 96, generator=generator)
    codes, scales, x = codes.to(KERNEL_DEVICE), scales.to(KERNEL_DEVICE), x.to(KERNEL_DEVICE)
    out = w8a16_matmul(x, codes, scales, None, num_sms=4, config=SMALL_TILES | VARIANTS[variant] | {"split_k": 2})
    assert rel_error(out, w8a16_reference(x, codes, scales, None)) < 1e-5


@needs_triton
def test_w8a16_default_config_splits_k_when_tiles_are_few():
    from llmserve.inference.kernels.w8a16_matmul import w8a16_config

    assert w8a16_config(1, 4096, 4096, num_sms=132)["split_k"] == 4  # 32 tiles -> 128 programs
    assert w8a16_config(1, 4096, 14336, num_sms=132)["split_k"] == 8  # deeper K: more splits
    assert w8a16_config(1, 28672, 4096, num_sms=132)["split_k"] == 1  # 224 tiles already
    prefill = w8a16_config(4096, 4096, 4096, num_sms=132)
    assert prefill["split_k"] == 1 and prefill["swap_ab"]  # the large swapped tile


@needs_triton
@pytest.mark.parametrize(("M", "N", "K"), [(2, 64, 2048), (600, 72, 96)])  # split-K decode; large swapped tiles
def test_w8a16_default_configs_match_reference(M, N, K):
    from llmserve.inference.kernels.w8a16_matmul import w8a16_config, w8a16_matmul

    generator = torch.Generator().manual_seed(12)
    codes, scales = quantize_weight_int8(torch.randn(N, K, generator=generator))
    x = torch.randn(M, K, generator=generator)
    bias = torch.randn(N, generator=generator)
    codes, scales, x, bias = (t.to(KERNEL_DEVICE) for t in (codes, scales, x, bias))
    config = w8a16_config(M, N, K, num_sms=8, activation_bytes=x.element_size())
    assert config["split_k"] > 1 or config.get("swap_ab")
    out = w8a16_matmul(x, codes, scales, bias, num_sms=8)
    assert rel_error(out, w8a16_reference(x, codes, scales, bias)) < 1e-5


@pytest.fixture
def exact_fp8_cast_in_interpreter(monkeypatch):
    """Triton 3.6's interpreter casts float32 -> float8 e4m3 without carrying a mantissa
    round-up into the exponent (124.3 becomes 64, not 128) and rounds ties up; compiled
    kernels use the hardware's round-to-nearest-even. Under the interpreter, substitute
    torch's cast for that one op so the test checks the kernel's own arithmetic exactly."""
    if HAS_CUDA or not HAS_TRITON:
        return
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def torch_fp8_cast(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            data = torch.from_numpy(src.data.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(data, dst_type.scalar)
        return original(self, src, dst_type, rounding_mode)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", torch_fp8_cast)


@needs_triton
@pytest.mark.parametrize(("num_tokens", "size"), [(1, 64), (6, 300), (3, 5000)])  # 5000: two tiles per row
def test_fp8_quant_kernel_matches_torch_bit_for_bit(exact_fp8_cast_in_interpreter, num_tokens, size):
    from llmserve.inference.kernels.fp8_quant import per_token_quant_fp8

    generator = torch.Generator().manual_seed(size)
    row_magnitudes = 10.0 ** torch.empty(num_tokens, 1).uniform_(-2, 2, generator=generator)
    x = torch.randn(num_tokens, size, generator=generator) * row_magnitudes
    if num_tokens > 1:
        x[1] = 0.0
    x = x.to(KERNEL_DEVICE)
    codes, scales = per_token_quant_fp8(x)
    ref_codes, ref_scales = quantize_per_token_fp8(x)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@needs_triton
def test_fp8_quant_kernel_reads_strided_rows(exact_fp8_cast_in_interpreter):
    from llmserve.inference.kernels.fp8_quant import per_token_quant_fp8

    wide = torch.randn(4, 96, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    x = wide[:, 16:80]  # row stride 96
    codes, scales = per_token_quant_fp8(x)
    ref_codes, ref_scales = quantize_per_token_fp8(x)
    assert torch.equal(scales, ref_scales) and torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


# --- CUDA paths (H200 or any sm89+ GPU) --------------------------------------------------------


def float32_reference(module, x: torch.Tensor) -> torch.Tensor:
    """The module's math in float32 (fp8: activations still quantized per token)."""
    x = x.float()
    if isinstance(module, Fp8Linear):
        x = dequantize(*quantize_per_token_fp8(x))  # what the fp8 GEMM reads of the activations
    bias = module.bias.float() if module.bias is not None else None
    return F.linear(x, dequantize(module.weight, module.weight_scale), bias)

# bfloat16 outputs round at 2^-9 relative; the CUDA paths also sum in another order (and the
# int8 reference rounds the dequantized weight to bfloat16 before its GEMM).
BF16_TOLERANCE = 1e-2


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("module_cls", [Int8Linear, Fp8Linear])
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 64, 130, 300, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_path_matches_reference_in_bf16(module_cls, num_tokens, bias):
    linear = random_linear(1024, 768, bias, seed=num_tokens).to("cuda", torch.bfloat16)
    module = module_cls.from_linear(linear)
    x = torch.randn(num_tokens, 1024, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    out = module(x)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, 768)
    assert rel_error(out, float32_reference(module, x)) < BF16_TOLERANCE
    assert rel_error(out, linear(x)) < (0.02 if module_cls is Int8Linear else 0.08)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("module_cls", [Int8Linear, Fp8Linear])
def test_cuda_path_replays_in_a_cuda_graph(module_cls):
    """Decode steps replay captured graphs: the forward must capture (no host sync) and a
    replay on new inputs must compute what an eager call does."""
    module = module_cls.from_linear(random_linear(4096, 1024, True, seed=3).to("cuda", torch.bfloat16))
    static_x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        module(static_x)  # warm up: compile the kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = module(static_x)
    new_x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    static_x.copy_(new_x)
    graph.replay()
    assert torch.equal(static_out, module(new_x))


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_tiny_model_on_cuda_bf16(tiny_model_dirs, method):
    """bfloat16 on its own already moves the logits of a float32 model; quantization may add
    at most its CPU bound on top of that."""
    model_dir = tiny_model_dirs["qwen2"]
    reference_logits = prefill_logits(load_tiny(model_dir, "cuda", torch.float32))
    model = load_tiny(model_dir, "cuda", torch.bfloat16)
    bf16_error = rel_error(prefill_logits(model), reference_logits)
    quantize_linears(model, method)
    error = rel_error(prefill_logits(model), reference_logits)
    print(f"qwen2 on CUDA vs float32: bf16 {bf16_error:.4f}, bf16 + {method} {error:.4f}")
    assert error < MODEL_LOGIT_BOUNDS[method] + bf16_error

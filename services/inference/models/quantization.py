"""Weight quantization of the decoder's linear layers: FP8 W8A8 and INT8 W8A16.

What is quantized: the four matrices of every decoder layer (qkv_proj, o_proj, gate_up_proj,
down_proj), ~93% of the weight bytes a Llama-3-8B decode step reads. The embedding table and
lm_head stay in the model dtype: the embedding is read one row per token (its size costs
memory, not bandwidth), and lm_head errors land directly on the logits that sampling reads,
for ~7% of the bytes. Norm weights and biases stay as they are (tiny).

Both methods are symmetric with one float32 scale per output channel, computed once at load
from the checkpoint weights (models/quant_codes.py: the rule and the pure functions).

  fp8   W8A8 (`Fp8Linear`): weights float8 e4m3 (qmax 448); activations quantized per token
        (row) at run time with the same amax / 448 rule (kernels/fp8_quant.py), then one float8
        tensor-core GEMM with row-wise scales, torch._scaled_mm (CUDA, compute capability >=
        8.9): out = (x_fp8 @ w_fp8.T) * x_scale[M, 1] * w_scale[1, N] + bias. Halves weight bytes
        and doubles tensor-core throughput (prefill). e4m3 keeps a relative precision of
        2^-4 per element on both operands.
  int8  W8A16 weight-only (`Int8Linear`): weights int8 (qmax 127, round to nearest), widened
        to the activation dtype inside the GEMM (kernels/w8a16_matmul.py), float32
        accumulation, the scale applied in the epilogue. Activations stay exact; the weight
        error is at most scale / 2 per element (a uniform 7-bit grid per row). Halves the
        bytes a decode step streams.

Which one when (H200, Llama-3-8B layer shapes, the four GEMMs of a layer per token batch M;
kernels/w8a16_matmul.py has the table): int8 is 1.2-1.4x faster than bf16 for M <= 32, even
at 64 and slower beyond (the GEMM becomes tensor-core bound; widening costs throughput). fp8
through torch._scaled_mm is ~15% slower than bf16 for M <= 32 (cuBLAS's row-wise fp8 kernels
at small M, plus the activation-quantization launch), even at 64, and 1.1-1.6x faster from
128 up (prefill: 1.6x). So int8 suits latency-bound serving (small batches), fp8 throughput.

Off CUDA (and where triton is missing) each module runs a float32 reference of the same math:
fp8 quantizes x per token to float8 and back, dequantizes the weight, multiplies in float32
and casts; int8 dequantizes the weight and calls F.linear. CPU tests check the semantics with
it; the CUDA paths are tested against it on a GPU.

`quantize_linears(model, method)` swaps the modules in place after loading; the original
weights are freed as it goes (and the CUDA allocator's cache emptied, so that KV-cache sizing
from free device memory sees the savings). Quantize after the model is on its device and in
its dtype: a later `model.to(dtype)` would cast float8 codes and float32 scales as well.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.inference.models.quant_codes import (
    dequantize,
    quantize_per_token_fp8,
    quantize_weight_fp8,
    quantize_weight_int8,
)

log = logging.getLogger(__name__)

METHODS = ("none", "fp8", "int8")
QUANTIZED_LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Attributes of MergedLinear that the model reads (output_sizes: the q/k/v split) or the
# loader wrote; carried over so the quantized module is a drop-in replacement.
_MERGED_ATTRIBUTES = ("output_sizes", "shard_names")
# torch._scaled_mm (cuBLASLt/CUTLASS) requires K and N to be multiples of 16.
FP8_ALIGNMENT = 16
FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada, Hopper and later


# --- modules ------------------------------------------------------------------------------------


class QuantizedLinear(nn.Module):
    """A quantized replacement of an nn.Linear (or MergedLinear): codes [N, K] in `weight`,
    float32 per-output-channel scales [N] in `weight_scale`, the bias (if any) in the model
    dtype. They are frozen parameters, so parameter-based accounting (bytes a decode step
    reads, parameter counts) sees the quantized sizes."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, source: nn.Linear):
        super().__init__()
        self.in_features = source.in_features
        self.out_features = source.out_features
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = nn.Parameter(scales, requires_grad=False)
        bias = source.bias
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        for name in _MERGED_ATTRIBUTES:
            if hasattr(source, name):
                setattr(self, name, getattr(source, name))

    @classmethod
    def check_supported(cls, linear: nn.Linear) -> None:
        """Raise ValueError if `linear` cannot be quantized by this method (before any swap)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "QuantizedLinear":
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        """Bytes one forward reads from parameters: codes + scales + bias."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        return self._forward_2d(x2d).view(*leading, self.out_features)

    def _forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={self.weight.dtype}"
        )


class Fp8Linear(QuantizedLinear):
    """W8A8: float8 e4m3 weights and per-token float8 activations, row-wise scaled GEMM."""

    @classmethod
    def check_supported(cls, linear: nn.Linear) -> None:
        n, k = linear.weight.shape
        if n % FP8_ALIGNMENT or k % FP8_ALIGNMENT:
            raise ValueError(
                f"fp8 needs in/out features divisible by {FP8_ALIGNMENT} (torch._scaled_mm), got [N={n}, K={k}]"
            )
        device = linear.weight.device
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
            capability = torch.cuda.get_device_capability(device)
            raise ValueError(f"fp8 needs compute capability >= 8.9 (float8 tensor cores), {device} has {capability}")

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        cls.check_supported(linear)
        codes, scales = quantize_weight_fp8(linear.weight.detach())
        return cls(codes, scales, linear)

    def _forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self._forward_scaled_mm(x)
        return self._forward_reference(x)

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        x_codes, x_scales = _per_token_quant_fp8(x)
        # _scaled_mm takes bias only for 16-bit outputs, in the output dtype.
        fused_bias = self.bias if x.dtype in (torch.bfloat16, torch.float16) else None
        out = torch._scaled_mm(
            x_codes,  # [M, K] row-major
            self.weight.t(),  # [K, N] column-major, as cuBLASLt requires on sm90
            scale_a=x_scales,  # [M, 1] float32
            scale_b=self.weight_scale.view(1, -1),  # [1, N] float32: row-wise scaling
            bias=fused_bias,
            out_dtype=x.dtype,
        )
        if self.bias is not None and fused_bias is None:
            out = out + self.bias
        return out

    def _forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        x_codes, x_scales = quantize_per_token_fp8(x)
        bias = self.bias.float() if self.bias is not None else None
        out = F.linear(dequantize(x_codes, x_scales), dequantize(self.weight, self.weight_scale), bias)
        return out.to(x.dtype)


class Int8Linear(QuantizedLinear):
    """W8A16 weight-only: int8 weights widened to the activation dtype inside the GEMM."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        codes, scales = quantize_weight_int8(linear.weight.detach())
        return cls(codes, scales, linear)

    def _forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and _has_triton():
            from llmserve.inference.kernels.w8a16_matmul import w8a16_matmul

            return w8a16_matmul(x, self.weight, self.weight_scale, self.bias, _num_sms(x.device))
        return self._forward_reference(x)

    def _forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.weight_scale).to(x.dtype), self.bias)


_MODULES: dict[str, type[QuantizedLinear]] = {"fp8": Fp8Linear, "int8": Int8Linear}


# --- swapping the model's layers ----------------------------------------------------------------


def quantize_linears(model: nn.Module, method: str) -> None:
    """Replace, in place, every decoder-layer linear (QUANTIZED_LINEAR_NAMES) with its quantized
    module for `method` ("none": nothing changes). Every layer is checked before the first
    swap, so an unsupported shape fails cleanly, naming the layer."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    if method == "none":
        return
    module_cls = _MODULES[method]
    targets = _quantizable_linears(model)
    for parent_name, parent, child_name in targets:
        try:
            module_cls.check_supported(getattr(parent, child_name))
        except ValueError as error:
            raise ValueError(f"{parent_name}.{child_name}: {error}") from None
    bytes_before = bytes_after = 0
    for _, parent, child_name in targets:
        linear = getattr(parent, child_name)
        bytes_before += sum(p.numel() * p.element_size() for p in linear.parameters())
        quantized = module_cls.from_linear(linear)
        del linear
        setattr(parent, child_name, quantized)  # drops the last reference to the original weight
        bytes_after += quantized.weight_bytes
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # return the freed weights, so mem_get_info-based KV sizing sees them
    log.info(
        "quantized %d linear layers to %s: %.1f MiB -> %.1f MiB",
        len(targets), method, bytes_before / 2**20, bytes_after / 2**20,
    )


def _quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(parent name, parent module, child name) of each linear to quantize. Parents, not the
    linears themselves, so holding this list does not keep the original weights alive."""
    return [
        (parent_name, parent, child_name)
        for parent_name, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if child_name in QUANTIZED_LINEAR_NAMES and isinstance(child, nn.Linear)
    ]


# --- CUDA helpers -------------------------------------------------------------------------------


@functools.cache
def _has_triton() -> bool:
    from llmserve.inference.kernels import is_available

    return is_available()


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Triton kernel on CUDA; the torch reference (same bits, ~5 launches) without triton."""
    if _has_triton():
        from llmserve.inference.kernels.fp8_quant import per_token_quant_fp8

        return per_token_quant_fp8(x)
    return quantize_per_token_fp8(x)

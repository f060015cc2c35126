"""Command-line flags for the torch engine's kernels and number formats, shared by the
inference service (`python -m llmserve.inference`) and `llmserve serve`, which passes them on."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmserve.inference.engine.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """--attention-backend, --kv-cache-dtype, --quantization (EngineConfig fields of the same
    names); `llmserve serve` takes them too and passes them on."""
    defaults = EngineConfig(model_path=Path("."), model_name="")
    kernels = p.add_argument_group("kernels and precision (torch backend)")
    kernels.add_argument(
        "--attention-backend", choices=ATTENTION_BACKENDS, default=defaults.attention_backend,
        help="attention and the small fused ops: triton = Triton kernels reading the paged KV cache "
        "in place, decode steps replayed as CUDA graphs unless --enforce-eager (CUDA; needs the "
        "triton package); portable = the portable path, any device; auto = triton on CUDA when "
        "triton imports, portable otherwise (always portable on CPU)",
    )
    kernels.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype,
        help="KV cache element type: auto = the model dtype; fp8 = float8 e4m3 (scale 1), half the "
        "bytes of bfloat16, so twice the tokens fit and attention reads half as much per step, at "
        "a small accuracy cost (needs the triton attention backend, so CUDA)",
    )
    kernels.add_argument(
        "--quantization", choices=QUANTIZATIONS, default=defaults.quantization,
        help="linear-layer weights; the lm_head and embeddings stay in --dtype. none = --dtype; "
        "fp8 = W8A8: float8 e4m3 weights with per-output-channel scales, activations quantized per "
        "token at run time, float8 tensor-core GEMMs (CUDA, compute capability >= 8.9); int8 = "
        "W8A16 weight-only: int8 weights with per-output-channel scales, dequantized inside the "
        "GEMM (halves the weight bytes a decode step reads). Off CUDA both run a slow float32 "
        "reference of the same math (for tests)",
    )

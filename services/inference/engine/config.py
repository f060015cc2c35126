"""Engine configuration: built once by the inference service's __main__ and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmserve.block_hash import DEFAULT_BLOCK_SIZE

BACKENDS = ("torch", "hf", "trtllm")
# torch backend attention/small-op implementation (models/attention_backend.py): "auto" = the
# Triton kernels on CUDA when triton imports, else the portable path; "triton" requires them;
# "portable" forces the portable path (any device).
ATTENTION_BACKENDS = ("auto", "portable", "triton")
# KV-cache element type: "auto" = the model dtype; "fp8" = float8 e4m3 with scale 1 (half the
# bytes attention reads per step; needs the triton backend).
KV_CACHE_DTYPES = ("auto", "fp8")
# Linear-layer weights (the lm_head and embeddings stay in the model dtype):
#   none  the model dtype;
#   fp8   W8A8: float8 e4m3 weights with per-output-channel scales, activations quantized per
#         token at run time, float8 tensor-core GEMMs (CUDA, compute capability >= 8.9);
#   int8  W8A16 weight-only: int8 weights with per-output-channel scales, dequantized inside
#         the GEMM (halves the bytes a decode step streams).
QUANTIZATIONS = ("none", "fp8", "int8")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_path: Path  # local HF checkpoint directory (config.json, *.safetensors, tokenizer.json)
    model_name: str
    backend: str = "torch"
    device: str = "cpu"  # "cpu", "cuda", "cuda:1"
    dtype: str = "float32"  # "float32", "bfloat16", "float16"
    block_size_tokens: int = DEFAULT_BLOCK_SIZE
    # KV pool size: an explicit block count wins; otherwise a fraction of free device memory
    # (CUDA) or a byte budget (CPU).
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.9
    kv_cpu_memory_bytes: int = 2 * 1024**3
    max_num_seqs: int = 256  # sequences running at once
    max_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decodes)
    max_context_tokens: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False  # CUDA: skip CUDA-graph capture
    attention_backend: str = "auto"  # see ATTENTION_BACKENDS
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    quantization: str = "none"  # see QUANTIZATIONS
    # CPU work of step N+1 (scheduling, input staging, streaming step N's tokens) runs while
    # the device computes step N; off = one step at a time (simpler to debug, slower on CUDA).
    async_scheduling: bool = True
    seed: int = 0  # engine-level seed for requests that bring none

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be positive, got {self.block_size_tokens}")

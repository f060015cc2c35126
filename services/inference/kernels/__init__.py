"""Triton kernels for the torch engine on CUDA: paged attention and the small fused ops.

  paged_decode   one query token per sequence, K/V read in place through the block table
                 (GQA: one program per (sequence, kv head, context split));
  paged_prefill  FlashAttention-style causal attention of prefill chunks over the paged cache
                 (the chunk's own K/V are written first, so a cached prefix is read the same way);
  rope_kv        rotary embedding of q and k, fused with writing k and v into their cache slots;
  rms_norm       RMSNorm, optionally fused with the residual add before it;
  activation     SwiGLU: silu(gate) * up in one pass;
  paged_kv       what both attention kernels share: the K/V tile gather through the block
                 table, its scores, the online-softmax state and step;
  w8a16_matmul   GEMM with int8 weights widened in registers (weight-only quantization);
  fp8_quant      per-token float8 quantization of activations (fp8 W8A8);
  block_copy     whole KV blocks from one pool to another by block ids (the KV pull's copy).

Every kernel has a torch reference next to it in the tests. The modules import triton at import
time, so import them only where triton exists (CUDA hosts; on CPU, tests run them under
TRITON_INTERPRET=1). `is_available()` is the check.
"""

from __future__ import annotations

import importlib.util


def is_available() -> bool:
    """True when triton can be imported (the kernels still need CUDA tensors, or the interpreter)."""
    return importlib.util.find_spec("triton") is not None

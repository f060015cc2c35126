"""Llama-family decoder over the paged KV cache: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3.

The variants differ only in a few switches read from config.json (DecoderConfig.from_hf):
q/k/v bias (Qwen2), per-head q/k RMSNorm and an explicit head_dim (Qwen3), RoPE scaling
(llama3, linear), sliding windows (Mistral, when set), tied embeddings. Numerics follow
transformers' implementations op for op (RMSNorm in float32, RoPE tables in float32 cast to
the model dtype) so greedy outputs match it token for token in float32.

The forward takes a flat batch of tokens (no padding) with their positions and the step's
attention metadata; q/k/v and gate/up projections are fused into one matmul each (the loader
packs the checkpoint's separate matrices). The residual stream is carried beside the hidden
states so that each norm can fuse the residual add before it.

Two implementations of the small ops, chosen once by `enable_kernels()`:
  torch (default; CPU and the reference): op by op as transformers, gather-based attention;
  kernels (CUDA): Triton RMSNorm(+residual), SwiGLU, RoPE fused with the KV-cache write, and
           paged attention reading blocks in place (models/kernel_attention.py). Same math
           with fewer roundings (the residual stream stays float32) and ~10 launches per
           layer instead of ~40.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.inference.models.attention import AttentionMetadata, KernelAttentionMetadata, paged_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3

    @classmethod
    def from_hf(cls, config: dict) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints write
        # `rope_theta` at the top level and `rope_scaling` with "type" or "rope_type".
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        return cls(
            theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", config.get("max_position_embeddings", 8192))
            ),
        )


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention

    @classmethod
    def from_hf(cls, config: dict) -> "DecoderConfig":
        """Read an HF config.json dict; raises ValueError for anything this decoder cannot run."""
        architecture = (config.get("architectures") or ["unknown"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {architecture!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        num_heads = int(config["num_attention_heads"])
        num_layers = int(config["num_hidden_layers"])
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(config.get("attention_bias", False)) and architecture != "MistralForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope=RopeConfig.from_hf(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,  # Qwen2 always has q/k/v bias, never o bias
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_windows=_sliding_windows(config, architecture, num_layers),
        )


def _sliding_windows(config: dict, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if window is None:
        return (None,) * num_layers
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if architecture == "MistralForCausalLM":
        return (int(window),) * num_layers
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and config.get("use_sliding_window"):
        first_sliding = int(config.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first_sliding else None for i in range(num_layers))
    return (None,) * num_layers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.use_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels and x.dim() == 2:
            from llmserve.inference.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        return self._reference(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        if self.use_kernels:
            from llmserve.inference.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        residual = residual + x
        return self._reference(residual), residual

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class MergedLinear(nn.Linear):
    """Several projections of the same input stacked on the output dimension (one matmul).

    `shard_names` name the checkpoint's separate matrices in output order; the loader copies
    each into its rows with `load_shard`.
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.shard_names = shard_names

    def load_shard(self, param: nn.Parameter, shard_name: str, loaded: torch.Tensor) -> None:
        index = self.shard_names.index(shard_name)
        offset = sum(self.output_sizes[:index])
        param.data[offset : offset + self.output_sizes[index]].copy_(loaded)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, computed exactly as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def float32_output_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) with cuBLAS's float32 accumulator written out instead of rounded to x's 16-bit
    dtype (CUDA); float32 models, CPU and quantized layers get linear(x). The kernel path uses
    it where the output is not a GEMM input: o_proj and down_proj (added to the float32
    residual stream) and the lm_head (float32 logits) - three of the roundings a bfloat16
    forward makes. Measured on an H200: as fast as a bf16 output at decode sizes, ~15% slower
    at 4k-token prefill (docs/benchmarks.md)."""
    if type(linear) is not nn.Linear or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return linear(x)
    out = torch.mm(x, linear.weight.t(), out_dtype=torch.float32)
    return out if linear.bias is None else out + linear.bias.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]; cos/sin [num_tokens, head_dim] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_index: int):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_index]
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], ["q_proj", "k_proj", "v_proj"], config.qkv_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, hidden, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta):
        """cos/sin: full-width tables in the model dtype (torch path) or half-width float32
        (kernel path, when `meta` is a KernelAttentionMetadata)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache
        if isinstance(meta, KernelAttentionMetadata):
            from llmserve.inference.models.kernel_attention import kernel_attention

            out = kernel_attention(q, k, v, cos, sin, k_cache, v_cache, meta, self.scale, self.sliding_window)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if isinstance(meta, KernelAttentionMetadata):
            return float32_output_linear(self.o_proj, out)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], ["gate_proj", "up_proj"], config.mlp_bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=config.mlp_bias)
        self.use_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.use_kernels:
            from llmserve.inference.kernels.activation import silu_and_mul

            return float32_output_linear(self.down_proj, silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_index: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, kv_cache, meta):
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it); the
        next norm adds them. The first layer gets residual None: hidden is the embedding."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match HF checkpoints except the fused qkv_proj / gate_up_proj."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Not a buffer: computed on CPU (as transformers does) even when the parameters are
        # built on the meta device, and moved with `place_rope` after `to_empty`.
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope)
        self.use_kernels = False
        self.tie_weights()

    def enable_kernels(self) -> None:
        """Switch the small ops to the Triton kernels (CUDA; the runner then passes a
        KernelAttentionMetadata). Imports triton."""
        import llmserve.inference.models.kernel_attention  # noqa: F401  (fail early without triton)

        self.use_kernels = True
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.use_kernels = True

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def place_rope(self, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v)
        meta: AttentionMetadata | KernelAttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm."""
        hidden = self.model.embed_tokens(input_ids)
        if isinstance(meta, KernelAttentionMetadata):
            cos, sin = self._rope_half_tables(positions)
        else:
            cos, sin = self._rope_tables(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_rows, vocab_size] for the rows that sample (on the kernel path
        straight from the float32 accumulator, not rounded to bfloat16 first)."""
        if self.use_kernels:
            return float32_output_linear(self.lm_head, hidden)
        return self.lm_head(hidden).float()

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _rope_half_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin [num_tokens, head_dim // 2] for the fused RoPE kernel."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()

"""Llama-family decoder over the paged KV cache: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3.

The variants differ only in a few switches read from config.json (models/decoder_config.py).
Numerics follow transformers' implementations op for op (RMSNorm in float32, RoPE tables in
float32 cast to the model dtype) so greedy outputs match it token for token in float32.

The forward takes a flat batch of tokens (no padding) with their positions and the step's
attention metadata; q/k/v and gate/up projections are fused into one matmul each (the loader
packs the checkpoint's separate matrices). The residual stream is carried beside the hidden
states so that each norm can fuse the residual add before it.

Attention, the RoPE table layout and the small ops (norms, SwiGLU, the projections into the
residual stream, the logits) run through the AttentionBackend the model is built with
(models/attention_backend.py, chosen once by the model runner): one code path here, whatever
implementation runs underneath.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.inference.models.attention_backend import AttentionBackend, KVLayer, RopeTables
from llmserve.inference.models.decoder_config import DecoderConfig
from llmserve.inference.models.layers import MergedLinear, RMSNorm
from llmserve.inference.models.rope import rope_inv_freq
from llmserve.inference.models.tensor_parallel import TensorParallel


class LlamaAttention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_index: int, attention: AttentionBackend, tp: TensorParallel):
        super().__init__()
        self.attention = attention
        self.tp = tp
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

    def attend(self, q, k, v, rope: RopeTables, kv_cache: KVLayer, meta) -> torch.Tensor:
        """project_qkv's q, k, v -> [num_tokens, num_heads, head_dim] (the backend's attention)."""
        return self.attention.attend(q, k, v, rope, kv_cache, meta, self.scale, self.sliding_window)

    def project_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim], before RoPE."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per-head norms (Qwen3): always the reference RMSNorm
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [num_tokens, num_heads, head_dim] into the residual stream's width."""
        out = out.reshape(out.shape[0], self.num_heads * self.head_dim)
        return self.tp.reduce(self.attention.ops.residual_projection(self.o_proj, out))


class LlamaMLP(nn.Module):
    def __init__(self, config: DecoderConfig, attention: AttentionBackend, tp: TensorParallel):
        super().__init__()
        self.ops = attention.ops
        self.tp = tp
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], ["gate_proj", "up_proj"], config.mlp_bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = self.ops.silu_and_mul(self.gate_up_proj(x))
        return self.tp.reduce(self.ops.residual_projection(self.down_proj, activated))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_index: int, attention: AttentionBackend, tp: TensorParallel):
        super().__init__()
        self.ops = attention.ops
        self.self_attn = LlamaAttention(config, layer_index, attention, tp)
        self.mlp = LlamaMLP(config, attention, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, rope: RopeTables, kv_cache: KVLayer, meta):
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it); the
        next norm adds them. The first layer gets residual None: hidden is the embedding."""
        q, k, v, residual = self.attention_inputs(hidden, residual)
        return self.after_attention(self.self_attn.attend(q, k, v, rope, kv_cache, meta), residual)

    # The layer's halves either side of attention: what a piecewise CUDA graph captures
    # (engine/piecewise_graphs.py); `forward` is the two with attention between.

    def attention_inputs(self, hidden, residual):
        """(hidden, residual) as `forward` takes them -> (q, k, v before RoPE, the residual stream)."""
        if residual is None:
            residual, hidden = hidden, self.ops.norm(self.input_layernorm, hidden)
        else:
            hidden, residual = self.ops.add_and_norm(self.input_layernorm, hidden, residual)
        return *self.self_attn.project_qkv(hidden), residual

    def after_attention(self, out: torch.Tensor, residual: torch.Tensor):
        """Attention's output [num_tokens, num_heads, head_dim] -> (`forward`'s result)."""
        hidden, residual = self.ops.add_and_norm(self.post_attention_layernorm, self.self_attn.project_out(out), residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: DecoderConfig, attention: AttentionBackend, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, attention, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match HF checkpoints except the fused qkv_proj / gate_up_proj.

    Split over ranks (`tp`, models/tensor_parallel.py), `config` is this rank's slice
    (TensorParallel.local_config) and the collectives join the slices; unsplit they are identities."""

    def __init__(self, config: DecoderConfig, attention: AttentionBackend, tp: TensorParallel | None = None):
        super().__init__()
        self.config = config
        self.attention = attention
        self.tp = tp if tp is not None else TensorParallel(config)
        self.model = LlamaModel(config, attention, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Not a buffer: computed on CPU (as transformers does) even when the parameters are
        # built on the meta device, and moved with `place_rope` after `to_empty`.
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def place_rope(self, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVLayer],  # per layer
        meta,  # the attention backend's metadata for this step (its build_metadata)
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm."""
        hidden = self.embed(input_ids)
        rope = self.attention.rope_tables(positions, self.inv_freq, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.embed(self.model.embed_tokens, input_ids)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's (hidden, residual) -> the hidden states the logits read."""
        return self.attention.ops.add_and_norm(self.model.norm, hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_rows, vocab_size] for the rows that sample (every rank gets all)."""
        return self.tp.gather_logits(self.attention.ops.logits(self.lm_head, hidden))

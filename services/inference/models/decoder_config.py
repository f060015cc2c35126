"""The decoder's configuration, read once from an HF config.json: DecoderConfig and RopeConfig.

The Llama-family variants differ only in a few switches read here: q/k/v bias (Qwen2), per-head
q/k RMSNorm and an explicit head_dim (Qwen3), RoPE scaling (llama3, linear), sliding windows
(Mistral, when set), tied embeddings. Anything the decoder cannot run raises ValueError here,
before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def check_splittable(config: DecoderConfig, size: int) -> None:
    """ValueError naming the shape that `size` ranks cannot split."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(
            f"tensor_parallel_size {size} and the model's {kv} KV heads: one must divide the other"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's intermediate size {config.intermediate_size}"
        )

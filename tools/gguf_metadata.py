"""What a GGUF file says about its model: its metadata as Python values and the LlamaConfig
fields (config.json) they give. The converter (llmserve.tools.gguf_convert) starts here."""

from __future__ import annotations

from typing import Any

import numpy as np


class UnsupportedGGUFError(ValueError):
    """The GGUF file uses an architecture, tensor or tokenizer this converter does not handle."""


def read_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of the file as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def llama_config(metadata: dict[str, Any], has_output_weight: bool) -> dict[str, Any]:
    """LlamaConfig fields as config.json spells them, from the `llama.*` metadata."""
    _reject_rope_scaling(metadata)
    hidden_size = int(metadata["llama.embedding_length"])
    num_heads = int(metadata["llama.attention.head_count"])
    head_dim = int(metadata.get("llama.attention.key_length") or hidden_size // num_heads)
    rope_theta = float(metadata.get("llama.rope.freq_base", 10000.0))
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(metadata.get("llama.vocab_size") or len(tokens)),
        "hidden_size": hidden_size,
        "intermediate_size": int(metadata["llama.feed_forward_length"]),
        "num_hidden_layers": int(metadata["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(metadata.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(metadata["llama.context_length"]),
        "rms_norm_eps": _round_f32(metadata["llama.attention.layer_norm_rms_epsilon"]),
        # Both spellings: transformers 4.x reads `rope_theta`, 5.x reads `rope_parameters`.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_output_weight,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def _round_f32(value: float) -> float:
    # GGUF stores 1e-5 as float32 (9.99999974e-06); the checkpoint it came from said 1e-05.
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _reject_rope_scaling(metadata: dict[str, Any]) -> None:
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedGGUFError(f"RoPE scaling {scaling!r} is not supported")

"""Convert a llama-architecture GGUF file into an ordinary HF checkpoint directory.

The services only read HF checkpoints (config.json + model.safetensors + tokenizer.json, see
llmserve/model_files.py), so a GGUF is converted once, up front:

    convert_gguf_to_hf("SmolLM2-135M-Instruct.Q4_1.gguf", out_dir)

writes into `out_dir`:
- config.json            LlamaConfig fields from the `llama.*` metadata
- model.safetensors      every tensor dequantized to float32, under HF names, with llama.cpp's
                         RoPE row permutation of Q and K undone
- tokenizer.json         byte-level BPE rebuilt from `tokenizer.ggml.*` with the `tokenizers` library
- tokenizer_config.json  special tokens and the chat template from `tokenizer.chat_template`
- generation_config.json bos/eos/pad ids

We read the file with the `gguf` package ourselves rather than through transformers' GGUF loader:
that loader needs accelerate at runtime and its tokenizer builder does not know every llama.cpp
pre-tokenizer (it has no "smollm", whose digits are split one by one).

Supported: `general.architecture == "llama"` and `tokenizer.ggml.model == "gpt2"` (byte-level BPE)
with the pre-tokenizers in `_PRE_TOKENIZERS`. Anything else raises `UnsupportedGGUFError` naming it,
rather than writing a checkpoint that loads but generates garbage.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# llama.cpp `tokenizer.ggml.token_type` values (llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# GGUF tensor name -> HF name, per transformer block ({i} is the layer index).
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


class UnsupportedGGUFError(ValueError):
    """The GGUF file uses an architecture, tensor or tokenizer this converter does not handle."""


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write an HF checkpoint for the model in `gguf_path` into `out_dir` (created if missing).

    The weights are written in float32. `progress` shows a tqdm bar (stderr) while tensors are
    dequantized. Returns `out_dir`.
    """
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    metadata = read_metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise UnsupportedGGUFError(f"{gguf_path.name}: architecture {architecture!r} is not supported (only 'llama')")
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = llama_config(metadata, has_output_weight="output.weight" in tensor_names)
    tokenizer = build_tokenizer(metadata)  # before the slow part: fail fast on an unknown tokenizer
    log.info(
        "converting %s (%d tensors, %d layers) into %s",
        gguf_path.name, len(reader.tensors), config["num_hidden_layers"], out_dir,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    write_weights(reader, config, out_dir / "model.safetensors", progress)
    # safetensors creates its file owner-only; give it the permissions our other files got.
    shutil.copymode(out_dir / "config.json", out_dir / "model.safetensors")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(metadata, config))
    _write_json(out_dir / "generation_config.json", generation_config(config))
    return out_dir


def read_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of the file as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


# ---------------------------------------------------------------------------------------------
# config.json


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


# ---------------------------------------------------------------------------------------------
# model.safetensors


def hf_tensor_name(gguf_name: str) -> str:
    """The HF LlamaForCausalLM parameter name for a GGUF tensor name."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSOR_NAMES:
        raise UnsupportedGGUFError(f"tensor {gguf_name!r} has no llama counterpart")
    layer, part = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.weight"


def reverse_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K projection rows.

    HF llama applies RoPE to the two halves of each head (rotate_half); llama.cpp rotates adjacent
    pairs, so its converter reorders each head's rows from [half0 | half1] to interleaved
    (r0, r0+d/2, r1, r1+d/2, ...). Reading the rows back as (pair, 2) and swapping the axes restores
    the halves. `num_heads` is the number of heads this projection has (KV heads for K).
    """
    # weight: [num_heads * head_dim, hidden]
    half_head_dim = weight.shape[0] // num_heads // 2
    pairs = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def dequantized(tensor) -> np.ndarray:
    """The tensor as float32 in numpy (row-major) shape: GGUF lists dims innermost first."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    expected_shape = tuple(int(d) for d in reversed(tensor.shape))
    if values.shape != expected_shape:
        raise UnsupportedGGUFError(
            f"tensor {tensor.name!r} ({tensor.tensor_type.name}) dequantized to {values.shape}, "
            f"expected {expected_shape}"
        )
    return values


def hf_tensor(tensor, config: dict[str, Any]) -> tuple[str, np.ndarray]:
    """(HF name, float32 values) for one GGUF tensor, Q/K rows put back in HF RoPE order."""
    name = hf_tensor_name(tensor.name)
    values = dequantized(tensor)
    if name.endswith("q_proj.weight"):
        values = reverse_rope_permutation(values, config["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
        values = reverse_rope_permutation(values, config["num_key_value_heads"])
    return name, np.ascontiguousarray(values)


def write_weights(reader, config: dict[str, Any], out_path: Path, progress: bool) -> None:
    """Dequantize every tensor and write them to one float32 safetensors file."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    weights = {}
    for tensor in tqdm(reader.tensors, desc="converting GGUF tensors", unit="tensor", disable=not progress):
        name, values = hf_tensor(tensor, config)
        weights[name] = values
    _check_all_layers_present(weights, config)
    save_file(weights, str(out_path), metadata={"format": "pt"})


def _check_all_layers_present(weights: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {
        f"model.layers.{layer}.{part}.weight"
        for layer in range(config["num_hidden_layers"])
        for part in _LAYER_TENSOR_NAMES.values()
    }
    missing = sorted(expected - weights.keys())
    if missing:
        raise UnsupportedGGUFError(f"the file lacks {len(missing)} tensors, e.g. {missing[:3]}")


# ---------------------------------------------------------------------------------------------
# tokenizer.json, tokenizer_config.json, generation_config.json


def _smollm_pre_tokenizer(add_prefix_space: bool):
    # llama.cpp's "smollm" split: every digit alone (\p{N}), then the GPT-2 regex.
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
        ]
    )


def _gpt2_pre_tokenizer(add_prefix_space: bool):
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


# `tokenizer.ggml.pre` -> pre-tokenizer that splits text the way the merges were learned.
_PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer, "gpt2": _gpt2_pre_tokenizer}


def build_tokenizer(metadata: dict[str, Any]):
    """A `tokenizers.Tokenizer` equal to the byte-level BPE the metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    model_type = metadata.get("tokenizer.ggml.model")
    pre_type = metadata.get("tokenizer.ggml.pre", "gpt2")
    if model_type != "gpt2":
        raise UnsupportedGGUFError(f"tokenizer model {model_type!r} is not supported (only byte-level BPE, 'gpt2')")
    if pre_type not in _PRE_TOKENIZERS:
        raise UnsupportedGGUFError(f"pre-tokenizer {pre_type!r} is not supported (known: {sorted(_PRE_TOKENIZERS)})")
    if "tokenizer.ggml.merges" not in metadata:
        raise UnsupportedGGUFError("byte-level BPE tokenizer without tokenizer.ggml.merges")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    # Byte-level tokens never contain a raw space (it is spelled "Ġ"), so one split is unambiguous.
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre_type](add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata, tokens)
    # Control tokens (<|im_start|> ...) must match whole and be skippable when decoding;
    # user-defined ones match whole but are ordinary text.
    typed = list(zip(tokens, token_types))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in typed if kind == _TOKEN_TYPE_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in typed if kind == _TOKEN_TYPE_USER_DEFINED]
    )
    if tokenizer.get_vocab_size() != len(tokens):
        raise UnsupportedGGUFError(f"rebuilt tokenizer has {tokenizer.get_vocab_size()} tokens, the file {len(tokens)}")
    return tokenizer


def _post_processor(metadata: dict[str, Any], tokens: list[str]):
    from tokenizers import processors

    byte_level = processors.ByteLevel(trim_offsets=False)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if not metadata.get("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return byte_level
    bos = tokens[bos_id]
    with_bos = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    return processors.Sequence([byte_level, with_bos])


def tokenizer_config(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS/EOS policy and the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": metadata.get("tokenizer.chat_template"),
    }


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config[key] is not None}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

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
with the pre-tokenizers llmserve.tools.gguf_tokenizer knows. Anything else raises `UnsupportedGGUFError` naming it,
rather than writing a checkpoint that loads but generates garbage.

This module converts the weights; the metadata and config.json come from llmserve.tools.gguf_metadata,
the tokenizer files from llmserve.tools.gguf_tokenizer.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from llmserve.tools.gguf_metadata import UnsupportedGGUFError, llama_config, read_metadata
from llmserve.tools.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config

log = logging.getLogger(__name__)

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


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

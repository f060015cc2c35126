"""Load an HF checkpoint (config.json + *.safetensors, sharded or not) into our decoder.

Parameters are created on the meta device and materialized once on the target device in the
target dtype, so nothing is randomly initialized and no full-size float32 copy ever exists.
Every parameter must be loaded from the checkpoint and every checkpoint tensor must land
somewhere, else loading fails naming the tensors: a silent mismatch would serve garbage.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from llmserve.inference.models.attention_backend import AttentionBackend
from llmserve.inference.models.decoder_config import DecoderConfig
from llmserve.inference.models.layers import MergedLinear
from llmserve.inference.models.llama import LlamaForCausalLM
from llmserve.inference.models.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint tensors that older exports carry and we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def load_model(
    model_dir: Path, config: DecoderConfig, device: torch.device, dtype: torch.dtype, attention: AttentionBackend,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None, tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """`weights`: (HF name, tensor) pairs to load instead of the directory's safetensors;
    `tp`: this rank's slice of a model split over ranks (`config` is then its local_config()),
    each tensor sliced as it is read."""
    if weights is None:
        weights = _checkpoint_tensors(safetensors_files(Path(model_dir)))
    if tp is not None:
        weights = tp.shard_weights(weights)
    return build_model(config, device, dtype, weights, attention, tp)


def build_model(
    config: DecoderConfig,
    device: torch.device,
    dtype: torch.dtype,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    attention: AttentionBackend,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Our decoder from (checkpoint name, tensor) pairs in HF naming: a checkpoint's tensors, or
    a transformers model's `state_dict().items()` (benchmarks build random weights on the GPU)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention, tp)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()  # re-tie: to_empty gives every parameter fresh storage
    model.place_rope(device)
    _load_weights(model, named_tensors)
    return model.eval()


def _checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _load_weights(model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())  # tied lm_head.weight appears once, as embed_tokens
    modules = dict(model.named_modules())
    unloaded = {name: _expected_shards(modules, name) for name in params}
    unexpected: list[str] = []
    for key, tensor in named_tensors:
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints store the copy too
        target = _target(key, params, modules)
        if target is None:
            unexpected.append(key)
            continue
        name, shard = target
        _copy(modules, params, name, shard, tensor)
        unloaded[name].discard(shard)
    missing = sorted(f"{name}[{shard}]" if shard else name for name, shards in unloaded.items() for shard in shards)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match {model.config.architecture}: "
            f"unexpected {unexpected[:8]}, missing {missing[:8]}"
        )


def _expected_shards(modules: dict, param_name: str) -> set[str]:
    module = modules[param_name.rpartition(".")[0]]
    return set(module.shard_names) if isinstance(module, MergedLinear) else {""}


def _target(key: str, params: dict, modules: dict) -> tuple[str, str] | None:
    """(our parameter name, shard name or "") for a checkpoint key, or None."""
    if key in params:
        return key, ""
    module_path, _, param_kind = key.rpartition(".")
    parent, _, shard = module_path.rpartition(".")
    for merged_name in ("qkv_proj", "gate_up_proj"):
        candidate = f"{parent}.{merged_name}"
        module = modules.get(candidate)
        if isinstance(module, MergedLinear) and shard in module.shard_names and f"{candidate}.{param_kind}" in params:
            return f"{candidate}.{param_kind}", shard
    return None


@torch.no_grad()
def _copy(modules: dict, params: dict, name: str, shard: str, loaded: torch.Tensor) -> None:
    param = params[name]
    if shard:
        modules[name.rpartition(".")[0]].load_shard(param, shard, loaded)
        return
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != model shape {tuple(param.shape)}")
    param.data.copy_(loaded)

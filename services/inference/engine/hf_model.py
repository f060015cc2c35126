"""HFModel: a transformers AutoModelForCausalLM as the hf backend runs it, one sequence at a time
on the model's own KV cache (a DynamicCache that grows with the sequence)."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from llmserve.inference.models.loader import torch_dtype
from llmserve.model_files import ModelFiles

log = logging.getLogger(__name__)


class HFModel:
    def __init__(self, files: ModelFiles, dtype: str, device: str):
        from transformers import AutoModelForCausalLM

        self.device = _resolve_device(device)
        weights_dtype = torch_dtype(dtype)  # a ValueError naming the choices before any loading
        log.info("loading %s (%s) with transformers on %s as %s", files.path, files.architecture, self.device, dtype)
        model = AutoModelForCausalLM.from_pretrained(files.path, dtype=weights_dtype)
        self._model = model.to(self.device).eval()
        self.vocab_size: int = self._model.get_output_embeddings().weight.shape[0]
        self._cache_kwarg, self._logits_kwargs = _forward_kwargs(self._model)

    @torch.inference_mode()
    def forward(self, new_token_ids: list[int], kv_cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits [vocab] (float32) for the position after `new_token_ids`, and the cache that
        now holds them. `kv_cache` None: a prefill from nothing."""
        input_ids = torch.tensor([new_token_ids], dtype=torch.long, device=self.device)  # [1, t]
        kwargs = dict(self._logits_kwargs)
        if kv_cache is not None:
            kwargs[self._cache_kwarg] = kv_cache
        out = self._model(input_ids=input_ids, use_cache=True, **kwargs)
        cache = getattr(out, "cache", None)
        return out.logits[0, -1].float(), cache if cache is not None else out.past_key_values


def _resolve_device(device: str) -> torch.device:
    """"cuda" means the current CUDA device; name its index so ModelInfo says e.g. "cuda:0"."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _forward_kwargs(model) -> tuple[str, dict]:
    """The cache keyword (transformers 5.x says `cache`, 4.x `past_key_values`) and the
    keyword that computes logits for the last position only (as generate() does, which keeps
    our greedy tokens bit-identical to it)."""
    parameters = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
    if "logits_to_keep" in parameters:
        return cache_kwarg, {"logits_to_keep": 1}
    if "num_logits_to_keep" in parameters:
        return cache_kwarg, {"num_logits_to_keep": 1}
    return cache_kwarg, {}

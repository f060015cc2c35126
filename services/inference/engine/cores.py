"""Which engine a backend name builds.

Two kinds of backend exist:
  - cores (`hf`, `torch`): synchronous EngineCores that an EngineLoop steps, on a thread of
    the server (EngineThread) or in a process of its own (EngineProcess);
  - `trtllm`: TensorRT-LLM brings its own scheduler and threads, so it is a core client itself
    (trtllm_engine.TrtllmClient), driven by AsyncEngine like the other two.
Backends are imported lazily: `hf` needs only transformers, `torch` is our own engine and
`trtllm` needs TensorRT-LLM, which most hosts lack. Construction loads the weights.
"""

from __future__ import annotations

import importlib

from llmserve.inference.engine.config import BACKENDS, EngineConfig
from llmserve.inference.engine.rank_worker import rank_config
from llmserve.inference.engine.types import EngineCore

# backend → (module, class) of the EngineCore; imported only when that backend is chosen.
_CORE_CLASSES = {
    "hf": ("llmserve.inference.engine.hf_engine", "HFEngineCore"),
    "torch": ("llmserve.inference.engine.torch_engine", "TorchEngineCore"),
}
# backends that are a core client of their own, not an EngineCore
CLIENT_CLASSES = {
    "trtllm": ("llmserve.inference.engine.trtllm_engine", "TrtllmClient"),
}


class BackendUnavailable(RuntimeError):
    """The chosen backend's module (or a library it needs) cannot be imported here."""


def create_engine_core(config: EngineConfig, rank_store_path: str | None = None) -> EngineCore:
    """The EngineCore for a core backend (`hf`, `torch`), weights loaded. `rank_store_path`: the
    rendezvous of a tensor-parallel engine (config.tensor_parallel_size > 1), whose rank 0
    this core is (engine/rank_processes.py spawns the other ranks)."""
    if config.backend in CLIENT_CLASSES:
        raise ValueError(f"backend {config.backend!r} runs its own engine, not an EngineCore: use create_engine")
    if config.backend not in _CORE_CLASSES:
        raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
    core_class = load_backend_class(config.backend, *_CORE_CLASSES[config.backend])
    if rank_store_path is None:
        return core_class(config)
    import torch

    from llmserve.inference.models.rank_group import RankGroup

    ranks = RankGroup.join(rank_store_path, config.tensor_parallel_size, 0, torch.device(rank_config(config, 0).device))
    return core_class(rank_config(config, 0), ranks=ranks)


def load_backend_class(backend: str, module_name: str, class_name: str):
    """The backend's class, or BackendUnavailable saying what is missing."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise BackendUnavailable(
                f"backend {backend!r} is not available: module {module_name} does not exist"
            ) from exc
        raise BackendUnavailable(
            f"backend {backend!r} is not available: {module_name} needs {exc.name!r}, which is not installed"
        ) from exc
    engine_class = getattr(module, class_name, None)
    if engine_class is None:
        raise BackendUnavailable(f"backend {backend!r} is not available: {module_name} defines no {class_name}")
    return engine_class

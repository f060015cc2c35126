"""Backend selection: EngineConfig.backend → the engine the servicer drives.

Two kinds of backend exist:
  - cores (`hf`, `torch`): synchronous EngineCores that AsyncEngine runs on its engine thread;
  - whole engines (`trtllm`): TensorRT-LLM brings its own scheduler and threads, so
    `TrtllmEngine` offers AsyncEngine's public methods itself (see ServingEngine).
Backends are imported lazily: `hf` needs only transformers, `torch` is our own engine and
`trtllm` needs TensorRT-LLM, which most hosts lack. Construction loads the weights, so what
these functions return is ready to serve.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import AsyncIterator, Protocol

from llmserve.inference.admission import AdmissionConfig
from llmserve.inference.async_engine import AsyncEngine, KvEventSink
from llmserve.inference.engine.config import BACKENDS, EngineConfig
from llmserve.inference.engine.engine_process import EngineProcess
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.types import EngineCore, EngineLoad, EngineOutput, EngineRequest, ModelInfo
from llmserve.observability import ObservabilityConfig

# backend → (module, class) of the EngineCore; imported only when that backend is chosen.
_CORE_CLASSES = {
    "hf": ("llmserve.inference.engine.hf_engine", "HFEngineCore"),
    "torch": ("llmserve.inference.engine.torch_engine", "TorchEngineCore"),
}
# backend → (module, class) of a whole engine (ServingEngine).
_ENGINE_CLASSES = {
    "trtllm": ("llmserve.inference.engine.trtllm_engine", "TrtllmEngine"),
}


class ServingEngine(Protocol):
    """What the servicer drives: AsyncEngine, or a backend's own async engine. Every method
    runs on the event loop; see AsyncEngine for the contract of each."""

    model_info: ModelInfo

    async def start(self) -> None: ...

    async def shutdown(self, drain_timeout_s: float) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    def submit(self, request: EngineRequest, on_output: Callable[[EngineOutput], None]) -> None: ...

    def detach(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def load(self) -> EngineLoad: ...

    def forward_kv_events(self, sink: KvEventSink) -> None: ...


class BackendUnavailable(RuntimeError):
    """The chosen backend's module (or a library it needs) cannot be imported here."""


def create_engine(
    config: EngineConfig, *, log_level: str = "INFO", observability: ObservabilityConfig = ObservabilityConfig()
) -> ServingEngine:
    """The engine for `config.backend`, weights loaded, not yet started. A core backend's core
    runs in a process of its own unless config.core_process is off (`log_level` and
    `observability`'s log format are its)."""
    if config.backend in _ENGINE_CLASSES:
        engine_class = _load_class(config.backend, *_ENGINE_CLASSES[config.backend])
        try:
            return engine_class(config)
        except ImportError as exc:  # the backend imports its library on construction
            raise BackendUnavailable(f"backend {config.backend!r} is not available: {exc}") from exc
    admission = AdmissionConfig.of(config)
    if config.core_process:
        return AsyncEngine(EngineProcess(config, log_level=log_level, observability=observability), admission=admission)
    return AsyncEngine(EngineThread(create_engine_core(config)), admission=admission)


def create_engine_core(config: EngineConfig) -> EngineCore:
    """The EngineCore for a core backend (`hf`, `torch`), weights loaded."""
    if config.backend in _ENGINE_CLASSES:
        raise ValueError(f"backend {config.backend!r} is a whole engine, not an EngineCore: use create_engine")
    if config.backend not in _CORE_CLASSES:
        raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
    return _load_class(config.backend, *_CORE_CLASSES[config.backend])(config)


def _load_class(backend: str, module_name: str, class_name: str):
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

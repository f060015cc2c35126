"""Backend selection: EngineConfig.backend → the AsyncEngine the servicer drives.

Every backend is served by one AsyncEngine (admission, the one table of requests in flight,
metrics); what differs is the core client behind it (engine/cores.py): an EngineProcess or an
EngineThread stepping an `hf` or `torch` core, or TensorRT-LLM's own engine (`trtllm`).
Construction loads the weights, so what create_engine returns is ready to start.
"""

from __future__ import annotations

from llmserve.inference.admission import AdmissionConfig
from llmserve.inference.async_engine import AsyncEngine, CoreClient
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.cores import CLIENT_CLASSES, BackendUnavailable, create_engine_core, load_backend_class
from llmserve.inference.engine.engine_process import EngineProcess
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.observability import ObservabilityConfig


def create_engine(
    config: EngineConfig, *, log_level: str = "INFO", observability: ObservabilityConfig = ObservabilityConfig()
) -> AsyncEngine:
    """The engine for `config.backend`, weights loaded, not yet started. A core backend's core
    runs in a process of its own unless config.core_process is off (`log_level` and
    `observability`'s log format are its)."""
    return AsyncEngine(_core_client(config, log_level, observability), admission=AdmissionConfig.of(config))


def _core_client(config: EngineConfig, log_level: str, observability: ObservabilityConfig) -> CoreClient:
    if config.backend in CLIENT_CLASSES:
        client_class = load_backend_class(config.backend, *CLIENT_CLASSES[config.backend])
        try:
            return client_class(config)
        except ImportError as exc:  # the backend imports its library on construction
            raise BackendUnavailable(f"backend {config.backend!r} is not available: {exc}") from exc
    if config.core_process:
        return EngineProcess(config, log_level=log_level, observability=observability)
    return EngineThread(create_engine_core(config))

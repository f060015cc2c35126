"""Preprocess configuration: built once by `__main__` from flags and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmserve.block_hash import DEFAULT_BLOCK_SIZE
from llmserve.buckets import BucketConfig
from llmserve.server_flags import DEFAULT_GRACE_PERIOD_S, DEFAULT_HOST

DEFAULT_MAX_OUTPUT_TOKENS = 4096
DEFAULT_NUM_WORKERS = 4
# Prompt bytes preprocess holds at once (waiting for a worker or being tokenized): a bound on its
# memory under a flood; a request that does not fit gets RESOURCE_EXHAUSTED with a retry delay.
DEFAULT_MAX_IN_FLIGHT_PROMPT_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PreprocessConfig:
    model_path: Path  # local HF checkpoint directory (needs config.json and tokenizer.json)
    model_name: str | None = None  # None: the name the checkpoint gives itself
    host: str = DEFAULT_HOST
    port: int = 0  # 0: any free port
    port_file: str | None = None  # written with the bound port once serving
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    block_size_tokens: int = DEFAULT_BLOCK_SIZE
    buckets: BucketConfig = field(default_factory=BucketConfig)
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    # None: the model's own context length. Lower it to match an engine started with a
    # shorter --max-context-tokens.
    max_context_tokens: int | None = None
    num_workers: int = DEFAULT_NUM_WORKERS  # threads that run tokenization off the event loop
    # None: derived (context x the longest token's bytes x 2): larger prompts are refused untokenized.
    max_prompt_bytes: int | None = None
    max_in_flight_prompt_bytes: int = DEFAULT_MAX_IN_FLIGHT_PROMPT_BYTES

    def __post_init__(self) -> None:
        for name in ("block_size_tokens", "max_output_tokens", "num_workers", "max_in_flight_prompt_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be at least 2, got {self.max_context_tokens}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

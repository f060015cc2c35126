"""Preprocess configuration: built once by `__main__` from flags and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmserve.block_hash import DEFAULT_BLOCK_SIZE
from llmserve.buckets import BucketConfig
from llmserve.cores import available_cores
from llmserve.observability import ObservabilityConfig
from llmserve.preprocessing.preprocessor import PreprocessorSettings
from llmserve.preprocessing.text_pieces import DEFAULT_MAX_TEXT_PIECES
from llmserve.server_flags import DEFAULT_GRACE_PERIOD_S, DEFAULT_HOST

DEFAULT_MAX_OUTPUT_TOKENS = 4096
DEFAULT_MAX_BATCH_PROMPTS = 32
# A prompt up to this many bytes, alone at light load, is tokenized on the event loop instead of a
# tokenizer thread (tokenizer_threads.py): ~2k tokens, ~1-2 ms of the loop at most.
DEFAULT_INLINE_MAX_PROMPT_BYTES = 8 * 1024
DEFAULT_PROMPT_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_REDIS_TIMEOUT_MS = 20
DEFAULT_REDIS_TTL_S = 3600
# Prompt bytes preprocess holds at once (waiting for a tokenizer thread or being tokenized): a bound on its
# memory under a flood; a request that does not fit gets RESOURCE_EXHAUSTED with a retry delay.
DEFAULT_MAX_IN_FLIGHT_PROMPT_BYTES = 256 * 1024 * 1024
# The shared-memory ring for long prompts' ids (llmserve.prompt_ids_region): 8M ids of prompts
# at least as long as the gateway asks (4k tokens by default) live in it at once; made at the
# first request that asks, so a preprocess no gateway shares memory with never makes it.
DEFAULT_PROMPT_IDS_REGION_MIB = 32
# An entry is reused no sooner than this after it was written; the gateway relays a reference
# for half of it. Well above a request's time between preprocess and inference (milliseconds).
DEFAULT_PROMPT_IDS_LEASE_S = 30.0


@dataclass(frozen=True, slots=True)
class PreprocessConfig:
    model_path: Path  # local HF checkpoint directory (needs config.json and tokenizer.json)
    model_name: str | None = None  # None: the name the checkpoint gives itself
    host: str = DEFAULT_HOST
    port: int = 0  # 0: any free port
    port_file: str | None = None  # written with the bound port once serving
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    observability: ObservabilityConfig = ObservabilityConfig()  # metrics endpoint, log format
    block_size_tokens: int = DEFAULT_BLOCK_SIZE
    length_buckets: BucketConfig = field(default_factory=BucketConfig)
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    # None: the model's own context length. Lower it to match an engine started with a
    # shorter --max-context-tokens.
    max_context_tokens: int | None = None
    # Threads that tokenize off the event loop, each running one micro-batch at a time.
    num_tokenizer_threads: int = field(default_factory=available_cores)
    max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS  # jobs in one micro-batch at most
    inline_max_prompt_bytes: int = DEFAULT_INLINE_MAX_PROMPT_BYTES  # 0: always on a tokenizer thread
    max_text_pieces: int = DEFAULT_MAX_TEXT_PIECES  # a lone long text is tokenized in up to this many pieces at once
    # None: derived (context x the longest token's bytes x 2): larger prompts are refused untokenized.
    max_prompt_bytes: int | None = None
    max_in_flight_prompt_bytes: int = DEFAULT_MAX_IN_FLIGHT_PROMPT_BYTES
    # Tokenized chat prefixes kept in process (0: no prefix reuse, every chat tokenized in full).
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    redis_url: str | None = None  # None: system prompts are cached in process only
    redis_timeout_ms: int = DEFAULT_REDIS_TIMEOUT_MS  # a slower Redis call counts as a miss
    redis_ttl_s: int = DEFAULT_REDIS_TTL_S
    prompt_ids_region_mib: int = DEFAULT_PROMPT_IDS_REGION_MIB  # 0: no ring, ids always inline
    prompt_ids_lease_s: float = DEFAULT_PROMPT_IDS_LEASE_S

    def __post_init__(self) -> None:
        for name in ("block_size_tokens", "max_output_tokens", "num_tokenizer_threads", "max_in_flight_prompt_bytes",
                     "max_text_pieces", "max_batch_prompts", "redis_timeout_ms", "redis_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("prompt_cache_bytes", "inline_max_prompt_bytes", "prompt_ids_region_mib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.prompt_ids_lease_s <= 0:
            raise ValueError(f"prompt_ids_lease_s must be positive, got {self.prompt_ids_lease_s}")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be at least 2, got {self.max_context_tokens}")

    @property
    def preprocessor_settings(self) -> PreprocessorSettings:
        return PreprocessorSettings(
            max_output_tokens=self.max_output_tokens, block_size_tokens=self.block_size_tokens,
            reuse_prefixes=self.prompt_cache_bytes > 0, model_name=self.model_name,
            max_context_tokens=self.max_context_tokens, max_prompt_bytes=self.max_prompt_bytes,
            length_buckets=self.length_buckets, max_text_pieces=self.max_text_pieces,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

"""What the inference service hands an engine core, and the core's interface. No protobuf here.

Request lifecycle inside a replica (docs/request-path.md has the whole path):
  servicer → OutputStream.start → AsyncEngine.submit(EngineRequest) → core client → EngineLoop
  → EngineCore.add_request; EngineCore.step() → [EngineOutput] → EngineLoop → core client →
  AsyncEngine (one CoreUpdate per step) → each request's OutputStream → the RPC's writer;
  cancel/deadline → AsyncEngine.abort → EngineCore.abort_request (frees KV blocks at once)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from llmserve.block_hash import HASH_VERSION, HashNamespace
from llmserve.engine_output import EngineOutput
from llmserve.sampling import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """One request as the engine sees it. `block_hashes` may be empty (the engine computes them,
    chained from its namespace seed for `cache_salt`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_ns: int
    block_hashes: list[int] = field(default_factory=list)
    block_size_tokens: int = 0
    block_hash_version: int = 0
    cache_salt: str = field(default="", repr=False)  # never logged: it names a tenant
    priority: int = 0
    deadline_ns: int = 0  # time.monotonic_ns() when the caller stops waiting; 0 = no deadline

    def usable_block_hashes(self, block_size: int) -> list[int]:
        """Its full prompt blocks' hashes when computed like the engine's (this block size and
        hash version); else none, and the engine computes them."""
        if self.block_size_tokens != block_size or self.block_hash_version != HASH_VERSION:
            return []
        return list(self.block_hashes[: len(self.prompt_token_ids) // block_size])


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    architecture: str
    max_context_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size_tokens: int
    dtype: str
    backend: str
    device: str
    hash_namespace: HashNamespace  # what its block hashes are namespaced by (llmserve.block_hash)

    @classmethod
    def describe(cls, config, files, *, vocab_size: int, backend: str, device: str) -> "ModelInfo":
        """What an engine core built from `config` (EngineConfig) and `files` (ModelFiles) serves."""
        return cls(
            model_name=config.model_name or files.model_name,
            architecture=files.architecture,
            max_context_tokens=served_context_tokens(config, files),
            vocab_size=vocab_size,
            eos_token_ids=files.eos_token_ids,
            block_size_tokens=config.block_size_tokens,
            dtype=config.dtype,
            backend=backend,
            device=device,
            hash_namespace=HashNamespace.of_model_dir(files.path, config.block_size_tokens),
        )


def served_context_tokens(config, files) -> int:
    """The model's context, lowered by config.max_context_tokens when that is set."""
    if config.max_context_tokens is None:
        return files.max_context_tokens
    return min(files.max_context_tokens, config.max_context_tokens)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Counts at one moment; `*_total` since the engine started. num_finished_total counts
    every request that ended, aborted ones (also in num_aborted_total) included."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_aborted_total: int = 0
    num_finished_total: int = 0
    prefix_cache_queried_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    num_preemptions_total: int = 0


# One change to a core's prefix cache, compact because each step's changes cross the
# engine-process pipe with its outputs (llmserve.kv_events is the typed form the service serves):
#   (parent_block_hash, [block_hash, ...])  consecutive blocks of one prefix entered the cache;
#                                            parent None: the first block starts a prompt
#   block_hash                              the block left the cache (evicted)
CacheEvent = tuple[int | None, list[int]] | int


@dataclass(frozen=True, slots=True)
class StepReport:
    """One EngineCore.step() that ran a batch, as the engine loop measured it: what the server's
    metrics need and the outputs do not say. It crosses the engine-process pipe with the step's
    outputs, so the metrics stay in the server process."""

    duration_s: float  # wall time of the call; with async scheduling about one step period
    num_seqs: int  # sequences in the batch it ran (EngineCore.scheduled_batch)
    num_tokens: int  # tokens it computed: prefill chunks and one per decoding sequence
    # Since the previous step ended, when the loop went on from it without waiting for work
    # (else None): the step and the loop's host work around it (commands, outputs, the pipe),
    # what a step costs the requests in it. Admission's step-time fit is on this.
    period_s: float | None = None

    @property
    def wall_s(self) -> float:
        return self.duration_s if self.period_s is None else max(self.duration_s, self.period_s)


class StepFailed(RuntimeError):
    """EngineCore.step() failed for `request_ids` only: the engine thread fails those requests
    and the others go on. Any other exception from step() fails every request in flight."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids


class EngineCore(Protocol):
    """A synchronous engine: everything runs on the engine thread, one step at a time.

    The EngineThread calls these methods only from itself, so implementations need no locks. A
    request is *in flight* from add_request until each of its sequences has had its final
    output from step(), or until abort_request. `step()` runs one schedule → execute → update
    iteration and returns the outputs it produced (at most one per running sequence, plus final
    outputs of finished ones).
    """

    model_info: ModelInfo

    def add_request(self, request: EngineRequest) -> None: ...

    def abort_request(self, request_id: str) -> bool:
        """Stop the request and free its KV blocks now; True if it was in flight."""
        ...

    def has_requests_in_flight(self) -> bool: ...

    def step(self) -> list[EngineOutput]:
        """May raise StepFailed to fail some requests only (see there)."""
        ...

    def load(self) -> EngineLoad: ...

    def scheduled_batch(self) -> tuple[int, int]:
        """(sequences, tokens) of the batch the latest step() ran ((0, 0): it ran none)."""
        ...

    def take_kv_events(self) -> list[CacheEvent]:
        """The prefix-cache changes since the previous call, in order; [] for a core without a
        prefix cache."""
        ...

"""Engine requests and sequences as the engine tests build them (small, explicit, built here
once). A test module fixes its own defaults with functools.partial, e.g. greedy requests:

    make_request = functools.partial(engine_objects.make_request, temperature=0.0)
"""

from __future__ import annotations

import time
from typing import Iterable

from llmserve.inference.engine.sequence import Sequence
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import SamplingParams

PROMPT = [5, 17, 42, 99, 100, 7, 250, 31]  # token ids below every test vocabulary
DEFAULT_MAX_TOKENS = 16


def make_request(
    request_id: str = "r", prompt: Iterable[int] = PROMPT, *, deadline_ns: int = 0, **sampling
) -> EngineRequest:
    """A request arriving now; `sampling`: SamplingParams fields (max_tokens DEFAULT_MAX_TOKENS
    unless given)."""
    sampling.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    return EngineRequest(
        request_id, list(prompt), SamplingParams(**sampling), time.monotonic_ns(), deadline_ns=deadline_ns
    )


def make_seq(
    prompt: int | Iterable[int] = (0, 1),
    *,
    seq_id: int = 1,
    output: Iterable[int] = (),
    seed: int | None = None,
    priority: int = 0,
    num_computed_tokens: int = 0,
    block_ids: Iterable[int] = (),
    block_hashes: Iterable[int] = (),
    hash_seed: int = 0,
    **sampling,
) -> Sequence:
    """The first sequence of request r<seq_id>: `prompt` then `output` tokens.

    `prompt`: token ids, or a count n: n ids from seq_id * 1000 up, so that no two sequences share
    a prefix by accident. `seed`: a seeded random stream for the sampler (none: no stream).
    `sampling`: SamplingParams fields (max_tokens DEFAULT_MAX_TOKENS unless given)."""
    prompt_ids = list(range(seq_id * 1000, seq_id * 1000 + prompt)) if isinstance(prompt, int) else list(prompt)
    sampling.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        sequence_index=0,
        token_ids=[*prompt_ids, *output],
        num_prompt_tokens=len(prompt_ids),
        sampling=SamplingParams(**sampling),
        priority=priority,
        block_ids=list(block_ids),
        block_hashes=list(block_hashes),
        hash_seed=hash_seed,
        num_computed_tokens=num_computed_tokens,
        rng=None if seed is None else _random_stream(seed),
    )


def _random_stream(seed: int):
    # torch only here: the scheduler and block manager tests run without it (STYLE.md)
    import torch

    return torch.Generator().manual_seed(seed)

"""Where every Sequence of the torch engine is made: a request's first sequence, and the n - 1
siblings it forks once its prompt is computed (they share the prompt's blocks, see
BlockManager.fork, and sample their first token from the parent's logits row).

Each sequence samples from its own torch.Generator on the engine's device: the request's seed,
or one derived from the engine seed per request; siblings derive theirs from the parent's.

A request with a response format gets a grammar matcher (engine/grammar.py), compiled once per
format and copied per sequence; a forked sibling copies its parent's, which has seen no output yet.

Block hashes: a request's own (from preprocess) when cut and defined like ours, else computed
lazily (Sequence.block_hash) from the engine's namespace seed for the request's cache salt.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from llmserve.block_hash import HashNamespace
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.grammar import Grammars
from llmserve.inference.models.transfers import device_tensor
from llmserve.inference.engine.sampler import is_plain_greedy
from llmserve.inference.engine.sequence import Sequence
from llmserve.inference.engine.types import EngineRequest


class SequenceFactory:
    def __init__(
        self, config: EngineConfig, device: torch.device, hash_namespace: HashNamespace, grammars: Grammars
    ):
        self._engine_seed = config.seed
        self._grammars = grammars
        self._block_size = config.block_size_tokens
        self._hash_namespace = hash_namespace
        self._device = device
        self._next_seq_id = 0
        self._num_requests = 0

    def first(self, request: EngineRequest) -> Sequence:
        """Sequence 0 of a new request."""
        seed = request.sampling.seed
        if seed is None:  # distinct streams per request, reproducible per engine seed
            seed = _derived_seed(self._engine_seed, self._num_requests + 1)
        self._num_requests += 1
        grammar = self._grammar(request)
        return Sequence(
            seq_id=self._new_seq_id(),
            request_id=request.request_id,
            sequence_index=0,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=request.sampling,
            arrival_ns=request.arrival_ns,
            priority=request.priority,
            block_hashes=request.usable_block_hashes(self._block_size),
            hash_seed=self._hash_namespace.seed(request.cache_salt),
            rng=self._generator(seed),
            is_plain_greedy=is_plain_greedy(request.sampling),
            grammar=grammar,
            is_plain=is_plain_greedy(request.sampling) and grammar is None and request.sampling.n == 1,
        )

    def prefix_probe(self, request: EngineRequest) -> Sequence:
        """A sequence of `request`'s prompt for looking its blocks up (pinning or pulling them,
        KV pull): its hashes are the ones the request would get, and making it changes
        nothing (no seq id, no random stream, no grammar: requests after it sample as before)."""
        return Sequence(
            seq_id=-1,
            request_id=request.request_id,
            sequence_index=0,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=request.sampling,
            block_hashes=request.usable_block_hashes(self._block_size),
            hash_seed=self._hash_namespace.seed(request.cache_salt),
        )

    def fork_siblings(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], list[tuple[Sequence, Sequence]], torch.Tensor]:
        """`seqs` sample from `logits` rows; those that fork (Sequence.forks_siblings) start their
        siblings here. Returns every sampling sequence (siblings after `seqs`), the
        (parent, child) pairs and the logits with a row per sampling sequence."""
        forks, rows = [], list(range(len(seqs)))
        for row, parent in enumerate(seqs):
            if parent.forks_siblings:
                forks += [(parent, self._sibling(parent, index)) for index in range(1, parent.sampling.n)]
                rows += [row] * (parent.sampling.n - 1)
        if not forks:
            return seqs, forks, logits
        return seqs + [child for _, child in forks], forks, logits[device_tensor(rows, logits.device)]

    def _sibling(self, parent: Sequence, index: int) -> Sequence:
        return Sequence(
            seq_id=self._new_seq_id(),
            request_id=parent.request_id,
            sequence_index=index,
            token_ids=parent.token_ids[: parent.num_prompt_tokens],
            num_prompt_tokens=parent.num_prompt_tokens,
            sampling=parent.sampling,
            arrival_ns=parent.arrival_ns,
            priority=parent.priority,
            block_hashes=list(parent.block_hashes),  # the prompt's: nothing after it is hashed yet
            hash_seed=parent.hash_seed,
            num_cached_tokens=parent.num_cached_tokens,
            was_admitted=True,
            rng=self._generator(_derived_seed(parent.rng.initial_seed(), index)),
            first_scheduled_ns=parent.first_scheduled_ns,
            is_plain_greedy=parent.is_plain_greedy,
            grammar=None if parent.grammar is None else parent.grammar.fork(),
        )

    def _grammar(self, request: EngineRequest):
        response_format = request.sampling.response_format
        return None if response_format is None else self._grammars.matcher(response_format)

    def _generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self._device)
        generator.manual_seed(seed)
        return generator

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id


# The key of derived seeds: the first block-hash seed (v1), which derived them before block
# hashes were namespaced, so that seeded streams stay as they were.
_DERIVED_SEED_KEY = hashlib.blake2b(b"llmserve-block-hash-v1", digest_size=8).digest()


def _derived_seed(seed: int, index: int) -> int:
    """A well-mixed 64-bit seed for stream `index` derived from `seed` (index 0 keeps `seed`, so
    sequence 0 of an n > 1 request samples like the same request with n = 1)."""
    if index == 0:
        return seed
    words = struct.pack("<3I", seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, index & 0xFFFFFFFF)
    return int.from_bytes(hashlib.blake2b(_DERIVED_SEED_KEY + words, digest_size=8).digest(), "little")

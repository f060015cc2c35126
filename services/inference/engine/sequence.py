"""One generated sequence: its tokens, its block table and its progress. Pure Python.

A request with n sequences starts as one Sequence (index 0); the engine forks the other n - 1
once the prompt is computed, sharing the prompt's blocks (see BlockManager.fork).

With async scheduling a sampled token is known on the device before the host sees it: the
scheduler appends PLACEHOLDER_TOKEN and notes the token's row in that step's sampled-token tensor
(placeholder_row), the next step reads its input id from that tensor on the device, and the
placeholder is overwritten once the step's results reach the host. Only the last token can be
a placeholder, and only for one step.

Invariants:
  token_ids = prompt + output; num_computed_tokens <= len(token_ids);
  every computed token is known (not PLACEHOLDER_TOKEN) once its step's results are processed;
  block_ids covers at least num_computed_tokens slots (block_size each);
  a sequence with a placeholder that is scheduled has one uncomputed token, the placeholder
    (it is recorded computed up to it; a preempted one waits until its value is known), so
    its step's input at that row is the placeholder (engine/decode_batch.py relies on it);
  the first num_registered_blocks blocks are full, computed and known to the prefix cache.

Who writes which field (one writer each; the others only read):
  SequenceFactory, at construction only: the identity, prompt, sampling, random-stream,
    grammar, is_plain_greedy and is_plain fields, and a forked sibling's copies of its parent's (prompt, block hashes, hash seed,
    num_cached_tokens, was_admitted, first_scheduled_ns);
  Sequence.block_hash: block_hashes (extended lazily from token_ids);
  BlockManager: block_ids, num_registered_blocks (the block table and its prefix-cache progress);
    block_ids is replaced by a new list at each change, never changed in place: a step's inputs
    and the persistent decode batch's rows (engine/decode_batch.py) hold it by reference, and a
    table that is the same object is the same table (issue 19: no copy or comparison per step);
  DecodeBatch: decode_row (the sequence's row in the persistent batch of decodes);
  Scheduler: the grammar matcher's state (it accepts each token as the token replaces its
    placeholder), and everything else - status, num_computed_tokens, num_cached_tokens, was_admitted,
    token_ids after construction (placeholders and their values), placeholder_row,
    is_finishing, first_scheduled_ns, first_token_ns, finish_reason, error_message, stop_ids,
    length_limit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from llmserve.block_hash import hash_block
from llmserve.sampling import FinishReason, SamplingParams


PLACEHOLDER_TOKEN = -1  # a sampled token still on its way from the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (holds no blocks)
    RUNNING = "running"  # holds blocks; scheduled every step until it finishes
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int  # unique within the engine, increasing with arrival: the FCFS tie-break
    request_id: str
    sequence_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_ns: int = 0
    priority: int = 0  # lower runs first
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes (llmserve.block_hash) of the full blocks of token_ids known so far;
    # extended lazily by block_hash(), block 0 chained from hash_seed: the namespace seed of the
    # request's cache salt (HashNamespace.seed).
    block_hashes: list[int] = field(default_factory=list)
    hash_seed: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    was_admitted: bool = False
    rng: Any = None  # the sampler's per-sequence random stream (a torch.Generator)
    # Structured output: an engine/grammar.GrammarMatcher that has seen exactly the known output
    # tokens (the sampler masks what it does not allow); None: free text.
    grammar: Any = None
    is_plain_greedy: bool = False  # sampler.is_plain_greedy(sampling): the sampler's fast path
    # is_plain_greedy, no grammar and n == 1: nothing about its sampling reads the host or
    # forks; a batch of only such rows skips every per-row check of the launch (issue 19).
    is_plain: bool = False
    # The token ids that end it with STOP (stop.stop_token_ids), set once when the scheduler
    # takes it: the update checks each token against it without a call.
    stop_ids: frozenset[int] = frozenset()
    # The tokens it may hold: it ends with LENGTH at this count (stop.length_limit), set with stop_ids.
    length_limit: int = 0
    # Row of the last token in the sampled tokens of the launched, not yet processed step;
    # -1 when it has no placeholder.
    placeholder_row: int = -1
    # Its placeholder ends it (max_tokens or the length limit): not scheduled again.
    is_finishing: bool = False
    decode_row: int = -1  # its row in the engine's DecodeBatch; -1: none
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    finish_reason: FinishReason | None = None
    error_message: str = ""  # why it finished with ERROR

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def has_placeholder(self) -> bool:
        return self.placeholder_row >= 0

    @property
    def forks_siblings(self) -> bool:
        """Sampling its first token now starts the request's other n - 1 sequences: only the
        first sequence does, once (later samples have a completion token before them)."""
        return self.sequence_index == 0 and self.sampling.n > 1 and self.num_completion_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_hash(self, block_index: int, block_size: int) -> int:
        """Chained hash of full block `block_index` (computed and remembered on first use)."""
        while len(self.block_hashes) <= block_index:
            start = len(self.block_hashes) * block_size
            parent = self.block_hashes[-1] if self.block_hashes else self.hash_seed
            self.block_hashes.append(hash_block(parent, self.token_ids[start : start + block_size]))
        return self.block_hashes[block_index]

    def block_token_ids(self, block_index: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[block_index * block_size : (block_index + 1) * block_size])

"""Which sequences run in the next step, and how many of their tokens; and what each step's
results do to them. Pure Python.

The engine's step talks to it through one seam (besides request-level `add` and `abort`):
  schedule()                      -> ScheduledBatch: the work of the next step;
  record_launch(launch)           the batch is queued on the device (with the siblings it forks);
  update_from_output(launch, ids) -> SampledTokens: the tokens that launch sampled, now on
                                  the host, with the stop rules of engine/stop.py applied;
  take_rejected()                 -> the sequences finished with ERROR since the last call.
At most one launch is in flight between record_launch and its update_from_output: recording a
launch needs every computed token known (its newly full blocks enter the prefix cache), so the
launch before it must have had its tokens recorded first. The scheduler checks that order.

Every step has a budget of `max_batched_tokens` new tokens and at most `max_num_seqs` running
sequences. A sequence's next tokens are simply those without K/V yet (num_uncomputed_tokens):
one for a decode, many for a prompt or a recomputation after preemption, so prefill and decode
are the same operation and mix freely in one batch. Order within a step:

  1. running decodes (one token each), oldest first: streams never stall behind prompts
     (a sequence whose placeholder is its last token, `is_finishing`, is skipped);
  2. running prefills, in chunks that fill the remaining budget;
  3. waiting sequences, in the order of the WaitingQueue (one queue per length bucket, taking
     turns; lowest `priority` first; first come first served within a bucket), each taking its
     prefix-cache hits and a chunk of the rest, while budget, room in the running set
     (max_num_seqs) and blocks last.
     The next sequence that does not fit ends admission for the step: the blocks that free up
     go to whoever's turn it is, so no bucket is starved by smaller prompts slipping past.

When a running sequence needs a block and none is free, the running sequence with the highest
(priority, seq_id) - lowest priority, newest - is preempted: its blocks are freed (cached
ones stay findable) and it rejoins its bucket's queue in its original place, to be recomputed.
No step admits waiting sequences after a preemption, which would only thrash.

A prompt that could never fit (more tokens than a sequence may hold) is finished with ERROR at
once instead of waiting forever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmserve.buckets import BucketConfig
from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from llmserve.inference.engine.step_output import LaunchedBatch, SampledTokens
from llmserve.inference.engine.stop import finish_at_token, finish_by_grammar, length_limit, stop_token_ids
from llmserve.inference.engine.waiting_queue import WaitingQueue, queue_key
from llmserve.sampling import FinishReason


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_batched_tokens: int
    max_seq_tokens: int  # most tokens (prompt + output) one sequence may hold
    enable_chunked_prefill: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    length_buckets: BucketConfig = BucketConfig()


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: seqs[i] computes its next num_new_tokens[i] tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # (src, dst) block copies to make before the forward (copy-on-fork of partial blocks).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The first num_decodes sequences are decodes: each computes its one uncomputed token, so
    # each samples; what follows is checked one by one (issue 19: at 256 decodes a check per
    # sequence per step was ~20 µs). 0 for a batch built by hand: every entry is checked.
    num_decodes: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, index: int) -> bool:
        """True if seqs[index] computes its last token this step, so it samples a new one."""
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] == seq.num_tokens

    def sampling_indexes(self) -> list[int]:
        """Indexes of the sequences that sample this step, in batch order (samples(i)): the
        decodes, then those of the rest whose chunk ends their tokens."""
        seqs, num_new_tokens, num_decodes = self.seqs, self.num_new_tokens, self.num_decodes
        rest = [
            i for i in range(num_decodes, len(seqs))
            if seqs[i].num_computed_tokens + num_new_tokens[i] == len(seqs[i].token_ids)
        ]
        return [*range(num_decodes), *rest]

    def one_token_indexes(self) -> list[int]:
        """Indexes of the sequences that compute one token this step (decodes, and one-token
        chunks of a prefill), in batch order."""
        num_new_tokens, num_decodes = self.num_new_tokens, self.num_decodes
        rest = [i for i in range(num_decodes, len(num_new_tokens)) if num_new_tokens[i] == 1]
        return [*range(num_decodes), *rest]

    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample this step, in batch order (before the step is recorded)."""
        seqs = self.seqs
        return [seqs[i] for i in self.sampling_indexes()]

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    def remove(self, seq: Sequence) -> int:
        """Drop a sequence scheduled earlier in this step; returns its token count."""
        index = self.seqs.index(seq)
        del self.seqs[index]
        if index < self.num_decodes:
            self.num_decodes -= 1
        return self.num_new_tokens.pop(index)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting = WaitingQueue(config.length_buckets)
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions_total = 0
        self._rejected: list[Sequence] = []
        self._block_copies_to_make: list[tuple[int, int]] = []
        self._unprocessed_launch: LaunchedBatch | None = None  # recorded, its tokens not yet

    # --- requests ----------------------------------------------------------------------------

    @property
    def has_unfinished_sequences(self) -> bool:
        """A sequence is waiting, running or rejected and not yet taken: a request in flight."""
        return bool(self.running or self.waiting or self._rejected)

    def add(self, seq: Sequence) -> None:
        seq.stop_ids = stop_token_ids(seq.sampling, self.config.eos_token_ids)
        seq.length_limit = length_limit(seq.num_prompt_tokens, seq.sampling, self.config.max_seq_tokens)
        if seq.num_tokens > self.config.max_seq_tokens:
            self._reject(seq)
            return
        self._enqueue(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request as CANCELLED, freeing its blocks now."""
        aborted = [s for s in [*self.running, *self.waiting] if s.request_id == request_id]
        for seq in aborted:
            self._finish(seq, FinishReason.CANCELLED)
        rejected = [s for s in self._rejected if s.request_id == request_id]
        self._rejected = [s for s in self._rejected if s.request_id != request_id]
        for seq in rejected:
            seq.finish_reason = FinishReason.CANCELLED
        return aborted + rejected

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(block_copies=self._block_copies_to_make)
        self._block_copies_to_make = []
        budget = self.config.max_batched_tokens
        num_preempted_before = self.num_preemptions_total
        block_size = self.block_manager.block_size
        running = SequenceStatus.RUNNING
        seqs, num_new_tokens = batch.seqs, batch.num_new_tokens
        prefills = []
        # Decodes are scheduled as they come, prefills after them: one pass over the running
        # sequences (a copy: preemption removes from the list), in admission order.
        for seq in tuple(self.running):
            if budget == 0:
                break
            if seq.is_finishing or seq.status is not running:
                continue  # its placeholder ends it; or preempted earlier in this loop
            if len(seq.token_ids) - seq.num_computed_tokens != 1:
                prefills.append(seq)
            elif seq.num_computed_tokens < len(seq.block_ids) * block_size:
                # The common case: its token fits a block it holds (no allocation).
                seqs.append(seq)
                num_new_tokens.append(1)
                budget -= 1
            else:
                budget -= self._schedule_running(seq, budget, batch)
        batch.num_decodes = len(seqs)  # so far only decodes were added (and preempted ones removed)
        for seq in prefills:
            if budget == 0:
                break
            if seq.status is running:  # else preempted earlier in this step
                budget -= self._schedule_running(seq, budget, batch)
        if self.num_preemptions_total == num_preempted_before:
            self._admit_waiting(budget, batch)
        return batch

    def record_launch(self, launch: LaunchedBatch) -> None:
        """`launch` is queued on the device: its tokens count as computed (the device runs the
        steps in order), its siblings start, each of its sampling sequences gets a PLACEHOLDER_TOKEN
        placeholder, and its newly full blocks enter the prefix cache. The launch before it
        must have had its tokens recorded (update_from_output) first."""
        assert self._unprocessed_launch is None, "the launch before must have its tokens recorded first"
        batch = launch.batch
        finished = SequenceStatus.FINISHED
        for seq, num_new_tokens in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is not finished:  # else a token of the step before stopped it
                seq.num_computed_tokens += num_new_tokens
        for parent, child in launch.forks:
            self._fork(parent, child)
        for row, seq in enumerate(launch.sampling_seqs):
            if seq.status is not finished:
                token_ids = seq.token_ids
                token_ids.append(PLACEHOLDER_TOKEN)
                seq.placeholder_row = row
                seq.is_finishing = len(token_ids) >= seq.length_limit  # stop.reaches_length_limit
        block_size = self.block_manager.block_size
        for seq in batch.seqs:  # a finished sequence holds no blocks: nothing to register
            if seq.num_computed_tokens // block_size > seq.num_registered_blocks:  # a block just filled
                self.block_manager.register_computed_blocks(seq)
        self._unprocessed_launch = launch

    def update_from_output(self, launch: LaunchedBatch, token_ids: list[int]) -> SampledTokens:
        """The tokens `launch` sampled (row i: launch.sampling_seqs[i]), now on the host: each
        replaces its placeholder (and advances the sequence's grammar matcher, if it has one),
        and the stop rules finish sequences (their blocks return to the pool at once). A token
        of a sequence finished before (aborted, or stopped by its token the step before) is
        discarded."""
        assert launch is self._unprocessed_launch, "tokens come for the launch recorded last"
        self._unprocessed_launch = None
        seqs = launch.sampling_seqs
        finishes: list[tuple[int, FinishReason, int | None]] = []
        kept: list[int] | None = None  # rows kept, once a row is dropped; None: every row
        finished = SequenceStatus.FINISHED
        # The per-token work a running sequence always needs, inline; the stop rules only for a
        # row that may stop (a stop token, its length limit marked at launch, a grammar) or
        # produce its first token. At 256 sequences this loop is a step's largest host cost
        # after the forward's launch (issue 19's profile).
        for row, (seq, token_id) in enumerate(zip(seqs, token_ids)):
            if seq.status is finished:
                if kept is None:
                    kept = list(range(row))
                continue
            seq_token_ids = seq.token_ids
            assert seq_token_ids[-1] == PLACEHOLDER_TOKEN, "only a sequence's last token is ever a placeholder"
            seq_token_ids[-1] = token_id
            seq.placeholder_row = -1
            if token_id in seq.stop_ids or seq.is_finishing or seq.grammar is not None or not seq.first_token_ns:
                finish = self._apply_stop_rules(seq, token_id)
                if finish is not None:
                    finishes.append((row if kept is None else len(kept), *finish))
            if kept is not None:
                kept.append(row)
        if kept is None:
            return SampledTokens(seqs, range(len(seqs)), token_ids[: len(seqs)], finishes)
        return SampledTokens([seqs[row] for row in kept], kept, [token_ids[row] for row in kept], finishes)

    def _apply_stop_rules(self, seq: Sequence, token_id: int) -> tuple[FinishReason, int | None] | None:
        """engine/stop.py's rules at `token_id`, just recorded as `seq`'s last token; finishes
        `seq` when one applies and returns (finish_reason, stop_token_id)."""
        if not seq.first_token_ns:
            seq.first_token_ns = time.monotonic_ns()
        num_tokens = len(seq.token_ids)
        finish_reason, stop_token_id = finish_at_token(
            token_id, num_tokens - seq.num_prompt_tokens, num_tokens, seq.sampling, seq.stop_ids,
            self.config.max_seq_tokens,
        )
        if finish_reason is None and seq.grammar is not None:
            finish_reason = finish_by_grammar(seq.grammar, token_id)
            if finish_reason is FinishReason.ERROR:
                seq.error_message = f"the response format's grammar refused token {token_id}"
        if finish_reason is None:
            return None
        self._finish(seq, finish_reason)
        return finish_reason, stop_token_id

    def take_rejected(self) -> list[Sequence]:
        """Sequences finished with ERROR (never scheduled) since the last call."""
        rejected, self._rejected = self._rejected, []
        return rejected

    # --- update ------------------------------------------------------------------------------

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Start a sibling of `parent` (whose prompt was just computed) on the parent's blocks;
        it waits (and recomputes) instead when the running set is full or no block is free."""
        child.stop_ids, child.length_limit = parent.stop_ids, parent.length_limit
        if len(self.running) < self.config.max_num_seqs and self.block_manager.can_fork(parent):
            copy = self.block_manager.fork(parent, child)
            if copy is not None:
                self._block_copies_to_make.append(copy)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            self._enqueue(child)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # --- scheduling --------------------------------------------------------------------------

    def _schedule_running(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """Schedule `seq`, preempting others (or itself) for blocks; returns net tokens used."""
        num_new_tokens = min(seq.num_uncomputed_tokens, budget)
        refunded = 0
        while not self.block_manager.allocate(seq, num_new_tokens):
            victim = max(self.running, key=queue_key)
            if victim in batch.seqs:
                refunded += batch.remove(victim)
            self._preempt(victim)
            if victim is seq:
                return -refunded
        batch.add(seq, num_new_tokens)
        return num_new_tokens - refunded

    def _admit_waiting(self, budget: int, batch: ScheduledBatch) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq.has_placeholder:
                break  # preempted (or forked) with a placeholder: its hashes need the value
            cached_block_ids = self.block_manager.find_cached_blocks(seq)
            num_cached_tokens = len(cached_block_ids) * self.block_manager.block_size
            num_new_tokens = seq.num_tokens - num_cached_tokens
            if num_new_tokens > budget:
                if not self.config.enable_chunked_prefill and not batch.is_empty:
                    break  # whole prompts only; an oversized one runs alone in a later step
                if self.config.enable_chunked_prefill:
                    num_new_tokens = budget
            if not self.block_manager.allocate(seq, num_new_tokens, cached_block_ids):
                break
            self.waiting.pop()
            self._start_running(seq, num_cached_tokens)
            batch.add(seq, num_new_tokens)
            budget -= num_new_tokens

    def _start_running(self, seq: Sequence, num_cached_tokens: int) -> None:
        """`seq` holds blocks now, the first num_cached_tokens' adopted from the prefix cache."""
        self.block_manager.count_prefix_lookup(seq.num_tokens, num_cached_tokens)
        seq.num_computed_tokens = num_cached_tokens
        if not seq.was_admitted:
            seq.num_cached_tokens = num_cached_tokens
            seq.was_admitted = True
        if not seq.first_scheduled_ns:
            seq.first_scheduled_ns = time.monotonic_ns()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_blocks(seq)
        self.num_preemptions_total += 1
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _reject(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.ERROR
        seq.error_message = (
            f"prompt has {seq.num_tokens} tokens but a sequence can hold at most "
            f"{self.config.max_seq_tokens} (context limit and KV pool of "
            f"{self.block_manager.num_blocks} blocks x {self.block_manager.block_size} tokens)"
        )
        self._rejected.append(seq)

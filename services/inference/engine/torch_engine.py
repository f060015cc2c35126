"""TorchEngineCore: llmserve's own engine - continuous batching over a paged KV cache with
prefix reuse, in PyTorch.

One step reads top to bottom:
  schedule  the Scheduler picks sequences and token counts (decodes, prefill chunks, new
            arrivals) within the token budget, allocating KV blocks, preempting when short;
  launch    the ModelRunner queues one forward over the flat batch (logits for the sequences
            whose last token is computed), progress is recorded, n > 1 requests fork their
            siblings and the Sampler queues the sampling; each sampled token is appended as a
            placeholder (sequence.PENDING_TOKEN);
  process   once the sampled ids reach the host: placeholders get their values, stop
            conditions finish sequences (their blocks return to the pool at once), full blocks
            enter the prefix cache, and an EngineOutput goes out per new token.

Async scheduling (EngineConfig.async_scheduling, the default): `step()` launches step N and
then processes step N-1, so the host schedules, stages and streams while the device computes;
step N reads the input ids that step N-1 sampled on the device (ModelRunner fills them).
Costs: a sequence that stops on a stop token has already been scheduled for one more token,
which is discarded; a sequence whose last token is in flight by length is not scheduled again
(`Sequence.is_finishing`). Penalties read the token history on the host, so a step that
samples with them processes the step before it first. Off: launch and process in one call.

Stop conditions: engine/stop.py (`max_seq_tokens` is the context limit, or the whole KV pool if
smaller).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from llmserve.block_hash import HASH_VERSION, hash_block
from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.kv_cache import device_tensor
from llmserve.inference.engine.model_runner import ModelRunner
from llmserve.inference.engine.sampler import PendingSample, Sampler, needs_token_history
from llmserve.inference.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from llmserve.inference.engine.sequence import PENDING_TOKEN, Sequence
from llmserve.inference.engine.stop import finish_at_token, reaches_length_limit
from llmserve.inference.engine.types import (
    EngineLoad,
    EngineOutput,
    EngineRequest,
    ModelInfo,
)
from llmserve.model_files import ModelFiles
from llmserve.sampling import FinishReason, TokenLogprob

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _LaunchedStep:
    """A step queued on the device whose sampled tokens the host has not processed yet."""

    seqs: list[Sequence]  # the sequences that sample: row i of the sampled tokens
    token_indices: list[int]  # where each one's placeholder sits in its token_ids
    sampled: PendingSample


class TorchEngineCore:
    """EngineCore on our own model runner. Not thread-safe: AsyncEngine calls it from one thread."""

    def __init__(self, config: EngineConfig):
        self.config = config
        files = ModelFiles.load(config.model_path, config.model_name)
        max_context_tokens = files.max_context_tokens
        if config.max_context_tokens is not None:
            max_context_tokens = min(max_context_tokens, config.max_context_tokens)
        self.runner = ModelRunner(config, files, max_context_tokens)
        num_blocks = self.runner.kv_cache.num_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size_tokens, config.enable_prefix_caching)
        max_seq_tokens = min(max_context_tokens, num_blocks * config.block_size_tokens)
        if max_seq_tokens < max_context_tokens:
            log.warning("the KV pool holds %d tokens, less than the context limit %d", max_seq_tokens, max_context_tokens)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_batched_tokens=config.max_batched_tokens,
                max_seq_tokens=max_seq_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
        )
        self.sampler = Sampler(files.eos_token_ids)
        self.model_info = ModelInfo(
            model_name=config.model_name or files.model_name,
            architecture=files.architecture,
            max_context_tokens=max_context_tokens,
            vocab_size=self.runner.vocab_size,
            eos_token_ids=files.eos_token_ids,
            block_size_tokens=config.block_size_tokens,
            dtype=config.dtype,
            backend="torch",
            device=str(self.runner.device),
        )
        self._num_unfinished_seqs: dict[str, int] = {}  # request id -> sequences not finished
        self._next_seq_id = 0
        self._num_requests_added = 0
        self._num_aborted_total = 0
        self._num_finished_total = 0
        self._in_flight: _LaunchedStep | None = None

    # --- EngineCore interface ----------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        assert request.prompt_token_ids, "the servicer rejects empty prompts"
        if request.request_id in self._num_unfinished_seqs:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        seed = request.sampling.seed
        if seed is None:  # distinct streams per request, reproducible per engine seed
            seed = _derived_seed(self.config.seed, self._num_requests_added + 1)
        self._num_requests_added += 1
        seq = Sequence(
            seq_id=self._new_seq_id(),
            request_id=request.request_id,
            sequence_index=0,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=request.sampling,
            arrival_ns=request.arrival_ns,
            priority=request.priority,
            block_hashes=self._usable_block_hashes(request),
            num_siblings_to_fork=request.sampling.n - 1,
            rng=self._generator(seed),
        )
        self._num_unfinished_seqs[request.request_id] = request.sampling.n
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        if request_id not in self._num_unfinished_seqs:
            return False
        self.scheduler.abort(request_id)
        del self._num_unfinished_seqs[request_id]
        self._num_aborted_total += 1
        self._num_finished_total += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._num_unfinished_seqs)

    def step(self) -> list[EngineOutput]:
        outputs = [out for seq in self.scheduler.take_rejected() for out in self._error_outputs(seq)]
        previous, self._in_flight = self._in_flight, None
        batch = self.scheduler.schedule()
        launched = None
        if not batch.is_empty:
            launched, previous = self._launch(batch, previous, outputs)
        if previous is not None:
            outputs += self._process(previous)
        if launched is not None:
            self.scheduler.register_computed_blocks(batch)  # every computed token is known now
            if self.config.async_scheduling:
                self._in_flight = launched
            else:
                outputs += self._process(launched)
        return outputs

    def load(self) -> EngineLoad:
        """Counts are sequences for num_running / num_waiting; requests for the totals (a request
        finished by abort counts in both num_aborted_total and num_finished_total)."""
        stats = self.block_manager.stats()
        return EngineLoad(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=stats.num_blocks_total,
            kv_blocks_used=stats.num_blocks_used,
            num_aborted_total=self._num_aborted_total,
            num_finished_total=self._num_finished_total,
            prefix_cache_queried_tokens_total=stats.prefix_queried_tokens_total,
            prefix_cache_hit_tokens_total=stats.prefix_hit_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions_total,
        )

    # --- update ------------------------------------------------------------------------------

    def _mark_scheduled(self, batch: ScheduledBatch) -> None:
        now_ns = time.monotonic_ns()
        for seq in batch.seqs:
            if not seq.first_scheduled_ns:
                seq.first_scheduled_ns = now_ns

    def _fork_siblings(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """Parents whose prompt was just computed start their n - 1 siblings, which sample their
        first token from the parent's logits row."""
        rows = list(range(len(seqs)))
        all_seqs = list(seqs)
        for row, parent in enumerate(seqs):
            for index in range(1, parent.num_siblings_to_fork + 1):
                child = self._sibling(parent, index)
                self.scheduler.add_fork(parent, child)
                all_seqs.append(child)
                rows.append(row)
            parent.num_siblings_to_fork = 0
        if len(all_seqs) == len(seqs):
            return seqs, logits
        return all_seqs, logits[device_tensor(rows, logits.device)]

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
            num_cached_tokens=parent.num_cached_tokens,
            was_admitted=True,
            rng=self._generator(_derived_seed(parent.rng.initial_seed(), index)),
            first_scheduled_ns=parent.first_scheduled_ns,
        )

    def _launch(
        self, batch: ScheduledBatch, previous: _LaunchedStep | None, outputs: list[EngineOutput]
    ) -> tuple[_LaunchedStep, _LaunchedStep | None]:
        """Queue the batch's forward and sampling; returns it and `previous` if still unprocessed."""
        self._mark_scheduled(batch)
        logits = self.runner.execute(batch, previous.sampled.token_ids if previous is not None else None)
        seqs = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        self.scheduler.advance(batch)
        seqs, logits = self._fork_siblings(seqs, logits)
        if previous is not None and any(needs_token_history(seq.sampling) for seq in seqs):
            outputs += self._process(previous)  # penalties count the token it brings
            previous = None
        sampled = self.sampler.launch(logits, seqs)
        token_indices = []
        for row, seq in enumerate(seqs):
            token_indices.append(seq.num_tokens)
            seq.token_ids.append(PENDING_TOKEN)
            seq.pending_token_row = row
            seq.is_finishing = self._ends_by_length(seq)
        return _LaunchedStep(seqs, token_indices, sampled), previous

    def _process(self, launched: _LaunchedStep) -> list[EngineOutput]:
        """The step's sampled tokens on the host: fill the placeholders, check stops, emit."""
        sampled = launched.sampled.result()
        outputs = []
        for seq, index, token_id, logprob in zip(launched.seqs, launched.token_indices, sampled.token_ids,
                                                 sampled.logprobs):
            if seq.is_finished:
                continue  # aborted, or stopped by the token before: this one is discarded
            seq.token_ids[index] = token_id
            if index == seq.num_tokens - 1:
                seq.pending_token_row = -1
            outputs.append(self._update(seq, index, token_id, logprob))
        return outputs

    def _update(self, seq: Sequence, index: int, token_id: int, logprob: TokenLogprob | None) -> EngineOutput:
        """token_ids[index] = token_id is known: stop conditions at that token, one output."""
        now_ns = time.monotonic_ns()
        if not seq.first_token_ns:
            seq.first_token_ns = now_ns
        finish = finish_at_token(
            token_id, index + 1 - seq.num_prompt_tokens, index + 1, seq.sampling,
            self.sampler.stop_token_ids(seq.sampling), self.scheduler.config.max_seq_tokens,
        )
        output = EngineOutput.for_token(seq.request_id, seq.sequence_index, token_id, logprob, finish)
        if output.is_finished:
            del seq.token_ids[index + 1 :]  # a token launched after this one is discarded
            seq.pending_token_row = -1
            self.scheduler.finish(seq, output.finish_reason)
            self._fill_final(output, seq, now_ns)
            self._count_finished_seq(seq.request_id)
        return output

    def _ends_by_length(self, seq: Sequence) -> bool:
        """The sequence's last token (just sampled) ends it by length, whatever its value."""
        return reaches_length_limit(seq.num_completion_tokens, seq.num_tokens, seq.sampling,
                                    self.scheduler.config.max_seq_tokens)

    def _fill_final(self, output: EngineOutput, seq: Sequence, now_ns: int) -> None:
        output.num_prompt_tokens = seq.num_prompt_tokens
        output.num_completion_tokens = seq.num_completion_tokens
        output.num_cached_tokens = seq.num_cached_tokens
        if seq.first_scheduled_ns:
            output.queue_time_ns = max(0, seq.first_scheduled_ns - seq.arrival_ns)
        if seq.first_token_ns:
            output.time_to_first_token_ns = max(0, seq.first_token_ns - seq.arrival_ns)
        output.total_time_ns = max(0, now_ns - seq.arrival_ns)

    def _error_outputs(self, seq: Sequence) -> list[EngineOutput]:
        """A rejected request ends every one of its n sequences with the error."""
        outputs = []
        for index in range(seq.sampling.n):
            output = EngineOutput(
                request_id=seq.request_id,
                sequence_index=index,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error_message=seq.error_message,
            )
            self._fill_final(output, seq, time.monotonic_ns())
            outputs.append(output)
        self._num_unfinished_seqs.pop(seq.request_id, None)
        self._num_finished_total += 1
        return outputs

    def _count_finished_seq(self, request_id: str) -> None:
        self._num_unfinished_seqs[request_id] -= 1
        if self._num_unfinished_seqs[request_id] == 0:
            del self._num_unfinished_seqs[request_id]
            self._num_finished_total += 1

    # --- helpers -----------------------------------------------------------------------------

    def _usable_block_hashes(self, request: EngineRequest) -> list[int]:
        """The request's block hashes when computed like ours; else none (computed lazily)."""
        if request.block_size_tokens != self.config.block_size_tokens or request.block_hash_version != HASH_VERSION:
            return []
        return list(request.block_hashes[: len(request.prompt_token_ids) // self.config.block_size_tokens])

    def _generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(seed)
        return generator

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id


def _derived_seed(seed: int, index: int) -> int:
    """A well-mixed 64-bit seed for stream `index` derived from `seed` (index 0 keeps `seed`, so
    sequence 0 of an n > 1 request samples like the same request with n = 1)."""
    if index == 0:
        return seed
    return hash_block(None, [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, index & 0xFFFFFFFF])

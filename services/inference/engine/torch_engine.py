"""TorchEngineCore: llmserve's own engine - continuous batching over a paged KV cache with
prefix reuse, in PyTorch.

One step reads top to bottom:
  schedule  the Scheduler picks sequences and token counts (decodes, prefill chunks, new
            arrivals) within the token budget, allocating KV blocks, preempting when short;
  execute   the ModelRunner queues one forward over the flat batch (logits for the sequences
            whose last token is computed), n > 1 requests fork their siblings
            (engine/sequence_factory.py) and the Sampler queues the sampling;
  update    Scheduler.update_from_output: the launched batch's progress is recorded (each
            sampled token appended as a placeholder, sequence.PENDING_TOKEN); sampled ids that
            reached the host replace their placeholders, stop conditions finish sequences
            (their blocks return to the pool at once), full blocks enter the prefix cache, and
            an EngineOutput goes out per new token (engine/engine_outputs.py).

Async scheduling (EngineConfig.async_scheduling, the default): `step()` launches step N and
then processes step N-1, so the host schedules, stages and streams while the device computes;
step N reads the input ids that step N-1 sampled on the device (ModelRunner fills them).
Costs: a sequence that stops on a stop token has already been scheduled for one more token,
which is discarded; a sequence whose pending token ends it by length is not scheduled again
(`Sequence.is_finishing`). Penalties read the token history on the host, so a step that
samples with them processes the step before it first. Off: launch and process in one call.

Stop conditions: engine/stop.py, applied by the Scheduler (`max_seq_tokens` is the context
limit, or the whole KV pool if smaller). Timings per step: engine/step_stats.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from llmserve.buckets import BucketConfig
from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_outputs import error_outputs, token_output
from llmserve.inference.engine.model_runner import ModelRunner
from llmserve.inference.engine.request_tracker import RequestTracker
from llmserve.inference.engine.sampler import PendingSample, Sampler, SamplerOutput, needs_token_history
from llmserve.inference.engine.scheduler import Scheduler, SchedulerConfig
from llmserve.inference.engine.sequence_factory import SequenceFactory
from llmserve.inference.engine.step_output import LaunchedBatch, SampledTokens, StepUpdate
from llmserve.inference.engine.step_stats import UNTIMED, StepStatsLog, StepTimer, Untimed
from llmserve.inference.engine.types import (
    CacheEvent, EngineLoad, EngineOutput, EngineRequest, ModelInfo, served_context_tokens,
)
from llmserve.model_files import ModelFiles

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _UnprocessedStep:
    """A launched step whose sampled tokens the host has not seen yet."""

    launch: LaunchedBatch
    sampled: PendingSample  # row i: launch.sampling_seqs[i]


class TorchEngineCore:
    """EngineCore on our own model runner. Not thread-safe: AsyncEngine calls it from one thread."""

    def __init__(
        self,
        config: EngineConfig,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        step_stats: StepStatsLog | None = None,
        sampler: Sampler | None = None,
    ):
        """`weights`: (HF name, tensor) pairs to serve instead of the checkpoint's safetensors
        (e.g. a transformers model's state_dict().items()); `step_stats`: where each step's
        measurements go (none are taken while it is None; it may be set between steps);
        `sampler`: one built on the model's EOS ids instead of the default (benchmarks
        observe the logits through it)."""
        self.config = config
        files = ModelFiles.load(config.model_path, config.model_name)
        max_context_tokens = served_context_tokens(config, files)
        self.runner = ModelRunner(config, files, max_context_tokens, weights)
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
                eos_token_ids=frozenset(files.eos_token_ids),
                length_buckets=BucketConfig.parse(config.length_buckets).limited_to(max_context_tokens),
            ),
            self.block_manager,
        )
        self.sampler = sampler if sampler is not None else Sampler(files.eos_token_ids)
        self.model_info = ModelInfo.describe(
            config, files, vocab_size=self.runner.vocab_size, backend="torch", device=str(self.runner.device)
        )
        self._sequences = SequenceFactory(config, self.runner.device, self.model_info.hash_namespace)
        self._requests = RequestTracker()
        self.step_stats = step_stats
        self._unprocessed_step: _UnprocessedStep | None = None
        self._num_scheduled_seqs = 0

    # --- EngineCore interface ----------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        assert request.prompt_token_ids, "the servicer rejects empty prompts"
        self._requests.add(request.request_id, request.sampling.n)
        self.scheduler.add(self._sequences.first(request))

    def abort_request(self, request_id: str) -> bool:
        if request_id not in self._requests:
            return False
        self.scheduler.abort(request_id)
        self._requests.abort(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self._requests.has_unfinished

    def step(self) -> list[EngineOutput]:
        """schedule -> execute -> update; with async scheduling the update also carries the
        tokens of the step the previous call launched."""
        timer = StepTimer(self.step_stats, self.runner.device) if self.step_stats is not None else UNTIMED
        batch = timer.measure("schedule_s", self.scheduler.schedule)
        self._num_scheduled_seqs = len(batch.seqs)
        previous, self._unprocessed_step = self._unprocessed_step, None
        outputs: list[EngineOutput] = []
        launched = None
        if not batch.is_empty:
            timer.gpu_begin()
            pending_tokens = previous.sampled.token_ids if previous is not None else None
            logits = timer.measure("execute_launch_s", self.runner.execute, batch, pending_tokens)
            seqs, forks, logits = self._sequences.fork_siblings(batch.sampling_seqs(), logits)
            if previous is not None and any(needs_token_history(seq.sampling) for seq in seqs):
                outputs = self._update(timer, sampled=previous)  # penalties count the token it brings
                previous = None
            sampled = timer.measure("sampler_launch_s", self.sampler.launch, logits, seqs)
            timer.gpu_end()
            launched = _UnprocessedStep(LaunchedBatch(batch, seqs, forks), sampled)
        outputs += self._update(timer, launched=launched, sampled=previous)
        if self.config.async_scheduling:
            self._unprocessed_step = launched
        elif launched is not None:
            outputs += self._update(timer, sampled=launched)
        timer.done(len(batch.seqs), batch.num_tokens)
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
            num_aborted_total=self._requests.num_aborted_total,
            num_finished_total=self._requests.num_finished_total,
            prefix_cache_queried_tokens_total=stats.prefix_queried_tokens_total,
            prefix_cache_hit_tokens_total=stats.prefix_hit_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions_total,
        )

    def num_scheduled_seqs(self) -> int:
        """The batch the latest step() launched (with async scheduling, it processed the one before)."""
        return self._num_scheduled_seqs

    def take_kv_events(self) -> list[CacheEvent]:
        return self.block_manager.take_events()

    # --- update ------------------------------------------------------------------------------

    def _update(
        self, timer: StepTimer | Untimed, launched: _UnprocessedStep | None = None, sampled: _UnprocessedStep | None = None
    ) -> list[EngineOutput]:
        """Tell the scheduler that `launched` is queued and `sampled`'s tokens (waited for here)
        are known; the outputs of what that finished or produced."""
        result = timer.measure("result_wait_s", sampled.sampled.result) if sampled is not None else None
        update = self.scheduler.update_from_output(
            launched=launched.launch if launched is not None else None,
            sampled=SampledTokens(sampled.launch.sampling_seqs, result.token_ids) if result is not None else None,
        )
        return self._outputs(update, result)

    def _outputs(self, update: StepUpdate, result: SamplerOutput | None) -> list[EngineOutput]:
        now_ns = time.monotonic_ns()
        outputs = []
        for seq in update.rejected:
            outputs += error_outputs(seq, now_ns)
            self._requests.finish_request(seq.request_id)
        for token in update.new_tokens:
            output = token_output(token, result.logprobs[token.row], now_ns)
            if output.is_finished:
                self._requests.finish_seq(token.seq.request_id)
            outputs.append(output)
        return outputs

"""TorchEngineCore: llmserve's own engine - continuous batching over a paged KV cache with
prefix reuse, in PyTorch.

One step reads top to bottom:
  schedule  the Scheduler picks sequences and token counts (decodes, prefill chunks, new
            arrivals) within the token budget, allocating KV blocks, preempting when short;
  execute   the step's inputs are built (decodes from the persistent batch of decoding
            sequences, engine/decode_batch.py), the ModelRunner queues one forward over the
            flat batch (logits for the sequences whose last token is computed), n > 1
            requests fork their siblings (engine/sequence_factory.py) and the Sampler queues
            the sampling;
  update    one launched step at a time, with its own sampled tokens: the step launched before
            (its LaunchedSample waited for) goes to Scheduler.update_from_output, whose stop
            rules finish sequences (their blocks return to the pool at once), and the new
            tokens go out as columns, an EngineOutput only for a token that finishes its
            sequence or carries logprobs (engine/engine_outputs.py); then the step just
            launched is recorded (Scheduler.record_launch: each sampled token appended as a
            placeholder, sequence.PLACEHOLDER_TOKEN; full blocks enter the prefix cache).

Async scheduling (EngineConfig.async_scheduling, the default on CUDA): `step()` launches step N and
then processes step N-1, the one launched step in flight (`_in_flight`), so the host
schedules, stages and streams while the device computes; step N reads the input ids that
step N-1 sampled on the device (ModelRunner fills them).
Costs: a sequence that stops on a stop token has already been scheduled for one more token,
which is discarded; a sequence whose placeholder ends it by length is not scheduled again
(`Sequence.is_finishing`). Penalties read the token history on the host, so a step that
samples with them processes the step before it first. Off: launch and process in one call.

Structured outputs (engine/grammar.py) need the same: the mask of a constrained row's next token
depends on the token before, which step N+1 is launched without. Of the two ways to get it,
holding such sequences back a step (scheduling them every other step) or filling their masks
after the sync, this engine does the second: `_launch` queues step N+1's forward first, then
processes step N (its tokens reach the host, every matcher accepts its token), then fills the
masks and queues the sampling. The forward, the step's bulk, still overlaps the host's work on
step N and the mask fill; only the sampling waits for them, and a constrained stream keeps
decoding every step.

Stop conditions: engine/stop.py, applied by the Scheduler (`max_seq_tokens` is the context
limit, or the whole KV pool if smaller). Timings per step: engine/step_stats.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager

import torch

from llmserve.buckets import BucketConfig
from llmserve.inference.engine.batch_inputs import build_step_inputs
from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.decode_batch import DecodeBatch
from llmserve.inference.engine.engine_outputs import error_outputs, step_outputs
from llmserve.inference.engine.grammar import Grammars, GrammarStats
from llmserve.inference.engine.kv_block_import import KvBlockImporter, KvImport, KvPullRefused, KvPullSource
from llmserve.inference.engine.kv_pool_export import KvPoolExport, KvPoolLayout
from llmserve.inference.engine.model_runner import ModelRunner
from llmserve.inference.engine.sampler import LaunchedSample, Sampler, SamplerOutput, reads_host_tokens
from llmserve.inference.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from llmserve.inference.engine.sequence_factory import SequenceFactory
from llmserve.inference.models.rank_group import SINGLE_RANK, RankGroup
from llmserve.inference.engine.step_output import LaunchedBatch
from llmserve.inference.engine.step_stats import UNTIMED, StepStatsLog, StepTimer, Untimed
from llmserve.engine_output import EngineOutput, StepOutputs
from llmserve.inference.engine.types import CacheEvent, EngineLoad, EngineRequest, ModelInfo, served_context_tokens
from llmserve.model_files import ModelFiles
from llmserve.tensor_transport import PeerIdentity, local_identity

if TYPE_CHECKING:
    from llmserve.inference.engine.mid_step_calls import StepWindows

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _LaunchedStep:
    """A step queued on the device, with the sampling whose tokens the host has not seen yet."""

    launch: LaunchedBatch
    sampled: LaunchedSample  # row i: launch.sampling_seqs[i]


class TorchEngineCore:
    """EngineCore on our own model runner. Not thread-safe: AsyncEngine calls it from one thread."""

    def __init__(
        self,
        config: EngineConfig,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        step_stats: StepStatsLog | None = None,
        sampler: Sampler | None = None,
        ranks: RankGroup = SINGLE_RANK,
    ):
        """`weights`: (HF name, tensor) pairs to serve instead of the checkpoint's safetensors
        (e.g. a transformers model's state_dict().items()); `step_stats`: where each step's
        measurements go (none are taken while it is None; it may be set between steps);
        `sampler`: one built on the model's EOS ids instead of the default (benchmarks
        observe the logits through it); `ranks`: the tensor-parallel group this core is rank 0
        of (it schedules and samples; the runner hands every step to the other ranks)."""
        if config.tensor_parallel_size != ranks.size:
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} needs its rank processes: serve it with "
                f"EngineProcess (the inference service), or create_engine_core with their rendezvous"
            )
        self.config = config
        files = ModelFiles.load(config.model_path, config.model_name)
        max_context_tokens = served_context_tokens(config, files)
        self.runner = ModelRunner(config, files, max_context_tokens, weights, ranks)
        self._ranks = ranks
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
        # The decoding sequences' rows, kept across steps (engine/decode_batch.py).
        self._decodes = DecodeBatch(config.max_num_seqs, self.runner.max_blocks_per_seq, config.block_size_tokens)
        self.sampler = sampler if sampler is not None else Sampler(files.eos_token_ids)
        self.model_info = ModelInfo.describe(
            config, files, vocab_size=self.runner.vocab_size, backend="torch", device=str(self.runner.device)
        )
        self._grammars = Grammars(files.path / "tokenizer.json", self.runner.vocab_size, files.eos_token_ids)
        self._sequences = SequenceFactory(config, self.runner.device, self.model_info.hash_namespace, self._grammars)
        self.step_stats = step_stats
        self._launched: _LaunchedStep | None = None  # async scheduling: launched, not processed
        self._scheduled_batch = (0, 0)
        self._kv_importer: KvBlockImporter | None = None  # made on the first pull
        # Where calls may run mid-step (engine/mid_step_calls.py): the forward and the result wait.
        self._window: Callable[[], ContextManager] = contextlib.nullcontext

    # --- EngineCore interface ----------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        assert request.prompt_token_ids, "the servicer rejects empty prompts"
        self.scheduler.add(self._sequences.first(request))

    def abort_request(self, request_id: str) -> bool:
        return bool(self.scheduler.abort(request_id))

    def has_requests_in_flight(self) -> bool:
        return self.scheduler.has_unfinished_sequences

    def step(self) -> StepOutputs:
        """schedule -> execute -> update; with async scheduling the update is of the step the
        previous call launched, else of this one. At most one launched step is processed per
        call, so each sequence gets at most one output."""
        timer = StepTimer(self.step_stats, self.runner.device) if self.step_stats is not None else UNTIMED
        batch = timer.measure("schedule_s", self.scheduler.schedule)
        self._scheduled_batch = (len(batch.seqs), batch.num_tokens)
        rejected = self._rejected_outputs()
        processed = None
        launched = None
        if not batch.is_empty:
            launched, processed = self._launch(batch, timer)
        if self._launched is not None:
            processed = self._process(self._take_launched(), timer)
        if launched is not None:
            timer.measure("record_s", self.scheduler.record_launch, launched.launch)
            self._launched = launched
            if not self.config.async_scheduling:
                processed = self._process(self._take_launched(), timer)
        timer.done(len(batch.seqs), batch.num_tokens)
        if processed is None:
            return StepOutputs(rejected)
        if rejected:
            processed.outputs[:0] = rejected
        return processed

    def load(self) -> EngineLoad:
        """Counts are sequences for num_running / num_waiting. The request totals are the engine
        loop's, which owns the requests (engine_loop.py)."""
        stats = self.block_manager.stats()
        return EngineLoad(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=stats.num_blocks_total,
            kv_blocks_used=stats.num_blocks_used,
            prefix_cache_queried_tokens_total=stats.prefix_queried_tokens_total,
            prefix_cache_hit_tokens_total=stats.prefix_hit_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions_total,
        )

    def scheduled_batch(self) -> tuple[int, int]:
        """The batch the latest step() launched (with async scheduling, it processed the one before)."""
        return self._scheduled_batch

    def open_windows(self, windows: StepWindows) -> None:
        """Let `windows`' calls run during each step's forward and result wait (the engine-core
        process, engine/mid_step_calls.py)."""
        self._window = windows.open

    def stop_ranks(self) -> None:
        """After the last step: the other tensor-parallel ranks leave their loop, and so does this one."""
        self.runner.stop_ranks()
        self._ranks.leave()

    def take_kv_events(self) -> list[CacheEvent]:
        return self.block_manager.take_events()

    # --- KV pull (issue 22): pinning our blocks for another replica, pulling its blocks ----------

    def kv_identity(self) -> PeerIdentity:
        """Who reads pulled blocks: this process, on the pool's device (read here, not in the
        server process, which must not initialize CUDA)."""
        self._kv_export()  # raises: not enabled
        return local_identity(self.runner.device)

    def kv_pin(self, request: EngineRequest, max_blocks: int, consumer: PeerIdentity) -> KvPullSource:
        """Pin the cached blocks of `request`'s prompt (at most `max_blocks`, 0: all) for
        `consumer` to copy: held until kv_release. Nothing cached: no blocks, nothing held."""
        export = self._kv_export()
        seq = self._sequences.prefix_probe(request)
        block_ids = self.block_manager.find_cached_blocks(seq)
        if max_blocks:
            block_ids = block_ids[:max_blocks]
        self.block_manager.hold(block_ids)
        export.mark_written()  # a block registered at launch may still be being computed
        return KvPullSource(export.offer(consumer), KvPoolLayout.of(self.runner.kv_cache.data), tuple(block_ids))

    def kv_release(self, block_ids: list[int]) -> None:
        self.block_manager.release(block_ids)

    def kv_import(self, request: EngineRequest, source: KvPullSource) -> KvImport:
        """Copy the blocks of `request`'s prompt that `source` pinned and we lack into our pool
        and prefix cache (engine/kv_block_import.py)."""
        if self._kv_importer is None:
            self._kv_export()  # raises: not enabled
            self._kv_importer = KvBlockImporter(self.runner.kv_cache, self.block_manager)
        seq = self._sequences.prefix_probe(request)
        return self._kv_importer.import_prefix(seq, source)

    def kv_forget(self, region_id: str) -> None:
        """Drop our mapping of another replica's pool (it died or restarted): a mapping keeps
        its memory, GPU memory included, allocated after its producer is gone."""
        if self._kv_importer is not None:
            self._kv_importer.forget(region_id)

    def close(self) -> None:
        """Unlink the exported KV pool's segment (--kv-pull); a process that exits without
        calling this leaves it to its reaper."""
        if self._kv_importer is not None:
            self._kv_importer.close()
        if self.runner.kv_cache.export is not None:
            self.runner.kv_cache.export.close()

    def _kv_export(self) -> KvPoolExport:
        export = self.runner.kv_cache.export
        if export is None:
            raise KvPullRefused("not_enabled", "this replica does not export its KV pool (--kv-pull is off)")
        return export

    def grammar_stats(self) -> GrammarStats:
        """Structured outputs' compile and mask-fill totals (bench/bench_grammar.py reads them)."""
        return self._grammars.stats

    # --- execute and update ------------------------------------------------------------------

    def _launch(self, batch: ScheduledBatch, timer: StepTimer | Untimed) -> tuple[_LaunchedStep, StepOutputs | None]:
        """Queue the batch's forward and sampling on the device. Sampling with penalties or a
        grammar reads the token history on the host (reads_host_tokens), so then the step in
        flight is processed first, after the forward is queued: its outputs come back with the
        launch (None when it was not processed)."""
        outputs = None
        timer.gpu_begin()
        launched_tokens = self._launched.sampled.token_ids if self._launched is not None else None
        sampling_indexes = batch.sampling_indexes()
        step_inputs = timer.measure("inputs_s", build_step_inputs, batch, self._decodes, sampling_indexes)
        with self._window():
            logits = timer.measure("execute_launch_s", self.runner.execute, batch, step_inputs, launched_tokens)
        seqs = [batch.seqs[i] for i in sampling_indexes]
        forks = []
        # The common batch (Sequence.is_plain): nothing forks, nothing reads host tokens; one scan.
        if not all(seq.is_plain for seq in seqs):
            seqs, forks, logits = self._sequences.fork_siblings(seqs, logits)
            if self._launched is not None and any(reads_host_tokens(seq) for seq in seqs):
                outputs = self._process(self._take_launched(), timer)
        sampled = timer.measure("sampler_launch_s", self.sampler.launch, logits, seqs)
        timer.gpu_end()
        return _LaunchedStep(LaunchedBatch(batch, seqs, forks), sampled), outputs

    def _take_launched(self) -> _LaunchedStep:
        step, self._launched = self._launched, None
        return step

    def _process(self, step: _LaunchedStep, timer: StepTimer | Untimed) -> StepOutputs:
        """Wait for the step's sampled tokens and hand them to the scheduler: its new tokens
        out."""
        with self._window():
            result = timer.measure("result_wait_s", step.sampled.result)
        return timer.measure("update_s", self._outputs_of, step.launch, result)

    def _outputs_of(self, launch: LaunchedBatch, result: SamplerOutput) -> StepOutputs:
        sampled = self.scheduler.update_from_output(launch, result.token_ids)
        return step_outputs(sampled, result.logprobs_by_row, time.monotonic_ns())

    def _rejected_outputs(self) -> list[EngineOutput]:
        now_ns = time.monotonic_ns()
        return [output for seq in self.scheduler.take_rejected() for output in error_outputs(seq, now_ns)]

"""Replica admission: whether AsyncEngine hands a request to the engine core, decided on the
event loop before anything is queued (so it is the same whether the core runs on a thread or in
a process).

Budgets (AdmissionConfig, from EngineConfig's admission flags), over the requests in flight:
  - waiting requests: admitted, but no sequence has produced a token yet;
  - waiting prompt tokens: the prompt tokens of those requests still to be prefilled: those of
    leading blocks another in-flight request holds will be found cached and are not counted;
  - KV demand (kv_demand.py): the blocks the admitted requests will hold together at their full
    length (prompt + max_tokens): each request's own blocks, and every full prompt block once
    however many share it (the prefix cache), plus, while sharers wait that could compute shared
    blocks twice at once, one step's blocks kept free for those twins; at most kv_blocks_total
    x kv_overcommit. At 1.0 the admitted requests fit the pool together even at their longest,
    so none is ever preempted for lack of blocks. A backend without a paged pool (0 blocks) has
    no KV budget.
Over a budget: ResourceExhausted naming it, with a retry hint (clamped):
  - waiting budgets: the time the waiting prompt tokens take to start at the prefill rate, i.e.
    until the queue has turned over. Not the time until this one request would fit: every
    client refused in a burst would come back at that same instant, refused again, and on a
    small CPU that retry storm through gateway and preprocess starves the engine itself;
  - KV budget: its excess blocks / the KV drain rate. A shared prefix's charge drains with its
    last holder only, and the twin reserve as sharers start, so the hint is an estimate;
  - before a rate is measured (the KV drain: before a request has finished):
    DEFAULT_RETRY_AFTER_MS, or longer while the step in progress has already run longer (a slow
    engine's first step).
A request that alone exceeds a whole budget can never be admitted: InvalidArgument.

Deadline (EngineRequest.deadline_ns), in the engine's own steps (finish_estimate.py): while
prompt tokens wait every step is a full one (the decodes, then prompt chunks up to
--max-batched-tokens), then steps are decode steps; both timed by the step-time fit of this
replica's own steps (step_time_model.py: a fixed part plus a part per sequence and per token, so
a CPU's step that grows with the batch and a GPU's that barely does are both measured, not
assumed), for the batch it joins (the sequences in flight with its own, at most --max-num-seqs).
Every step ahead starts after what is left of the step in progress (its length taken as the
last step's). A deadline counts as met when the estimate ends DEADLINE_SLACK of the time left
before it: the estimate errs (steps carry prompt chunks of requests admitted later, outputs
cross two processes), and a request admitted at 93% of its time left, with those after it
admitted up to the same edge, ended a few tokens short on a loaded CPU.
A request is refused at once, instead of being queued to die:
  - DeadlineExceeded when its own estimate exceeds the time it has left: its prompt ends in the
    step that computes the last waiting token (it queues last), its tokens follow one per step,
    and, when the sequences in flight with its own exceed --max-num-seqs, it cannot start before
    that excess has finished at the measured rate sequences finish. The refusal carries the
    estimate as an ErrorInfo detail and, where a retry of the call would fit, a RetryInfo. A
    retry keeps the call's deadline, so waiting costs it time left too: it fits once the work
    ahead has drained by the excess over DEADLINE_SLACK, if the work ahead lasts that long
    (`_deadline_retry_after_ms`); otherwise there is none and the client should stop;
  - ResourceExhausted when it would make a request admitted before it miss a deadline that
    request's estimate met without it (its prompt lengthens the full steps their remaining
    tokens fall in): a burst's first comers keep the promise their admission made. The hint:
    when the nearest of them will have finished.
What is not measured yet counts as zero: a cold replica admits.

Retry hints are spread: each is drawn between 0.5x and 1.5x of its estimate (`spread`), so the
clients a burst refused do not all return at the same instant to be refused together again; a
deadline refusal's between 1x and 1.5x of the earliest time a retry fits.

Measurements, learnt from the outputs AsyncEngine routes (`observe`, O(1) per output):
  step time               step_time_model.StepTimeModel, from the StepReports (`observe_steps`);
  prefill rate             drain_meter.StepPace (the waiting budgets' hints): prompt tokens
                           prefilled for requests that produced their first token, per second
                           of the steps that started any;
  sequence finishes        sequences finished per second of time in which a request was in flight;
  KV drain                 blocks of demand released by finished requests (a shared prompt
                           block with its last holder), per second of time in which a request
                           was in flight.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.block_hash import HashNamespace
from llmserve.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from llmserve.inference.drain_meter import DrainMeter, StepPace
from llmserve.inference.engine.config import (
    DEFAULT_KV_OVERCOMMIT,
    DEFAULT_MAX_NUM_SEQS,
    WAITING_PROMPT_CONTEXTS,
    WAITING_PROMPT_TOKENS_PER_REQUEST,
    EngineConfig,
    default_max_waiting_requests,
)
from llmserve.engine_output import EngineOutput
from llmserve.inference.engine.types import EngineRequest, StepReport
from llmserve.inference.finish_estimate import FinishEstimate, StepSchedule
from llmserve.inference.kv_demand import KvDemand, RequestDemand
from llmserve.inference.step_time_model import StepFit, StepTimeModel

DEFAULT_RETRY_AFTER_MS = 1000  # before the drain rate is measured
MIN_RETRY_AFTER_MS = 50  # about one step of a busy GPU: sooner would only be refused again
MAX_RETRY_AFTER_MS = 30_000
# Of the time a deadline leaves, what an estimate must end before it (see the module doc).
DEADLINE_SLACK = 0.1

# A retry hint of T ms → one drawn from [SPREAD_LOW x T, SPREAD_HIGH x T] (see the module doc).
SPREAD_LOW, SPREAD_HIGH = 0.5, 1.5
Spread = Callable[[float], float]


def jittered(rng: random.Random) -> Spread:
    return lambda ms: ms * rng.uniform(SPREAD_LOW, SPREAD_HIGH)


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The budgets (see EngineConfig's admission flags); the defaults are the flags' on an
    accelerator with the default --max-num-seqs."""

    max_waiting_requests: int = default_max_waiting_requests("cuda", DEFAULT_MAX_NUM_SEQS)
    max_waiting_prompt_tokens: int | None = None  # None: see WAITING_PROMPT_CONTEXTS
    kv_overcommit: float = DEFAULT_KV_OVERCOMMIT
    shares_prefix_blocks: bool = True  # the core's prefix cache is on (where it has a pool)
    max_batched_tokens: int = 2048  # the core's per-step token budget (EngineConfig's default)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # the core's running batch, at most (hf: 1)
    deadline_admission: bool = True  # refuse what the estimate says cannot meet its deadline

    @classmethod
    def of(cls, config: EngineConfig) -> "AdmissionConfig":
        max_waiting_requests = config.max_waiting_requests
        if max_waiting_requests is None:
            max_waiting_requests = default_max_waiting_requests(config.device, config.max_num_seqs)
        return cls(
            max_waiting_requests, config.max_waiting_prompt_tokens, config.kv_overcommit,
            config.enable_prefix_caching, config.max_batched_tokens,
            1 if config.backend == "hf" else config.max_num_seqs,  # hf generates one sequence at a time
            config.deadline_admission,
        )  # fmt: skip


@dataclass(slots=True, eq=False)
class Admitted:
    """The demand one in-flight request was admitted with, and its progress. AsyncEngine keeps
    it with the request (it owns which requests are in flight) and hands it back with each
    output (`observe`)."""

    demand: RequestDemand
    deadline_ns: int = 0  # 0: none
    num_sequences: int = 1
    num_tokens_left: int = 0  # of all its sequences together, at most
    # The admission-ordered count of prompt tokens to prefill, up to its own end: what is ahead
    # of it in the queue is this less what has started since.
    queue_end: int = 0
    is_waiting: bool = True  # no token produced yet
    has_started: bool = False  # produced a token (not merely ended while waiting)

    @property
    def num_decode_steps_left(self) -> int:
        return math.ceil(self.num_tokens_left / self.num_sequences)


class AdmissionController:
    """Admits requests against a replica's budgets and learns its drain rates. Runs on the event
    loop only. `kv_blocks_total` is the core's pool (EngineLoad), 0 for none."""

    def __init__(
        self,
        config: AdmissionConfig,
        *,
        kv_blocks_total: int,
        hash_namespace: HashNamespace,
        max_context_tokens: int,
        clock: Callable[[], int] = time.monotonic_ns,
        spread: Spread = jittered(random.Random()),
    ):
        self.max_waiting_requests = config.max_waiting_requests
        self.max_waiting_prompt_tokens = config.max_waiting_prompt_tokens or max(
            WAITING_PROMPT_CONTEXTS * max_context_tokens,
            WAITING_PROMPT_TOKENS_PER_REQUEST * config.max_waiting_requests,
        )
        self.kv_overcommit = config.kv_overcommit
        self.max_num_seqs = config.max_num_seqs
        self._max_batched_tokens = config.max_batched_tokens
        self._deadline_admission = config.deadline_admission
        self._max_kv_blocks = int(kv_blocks_total * config.kv_overcommit)
        self._block_size_tokens = hash_namespace.block_size_tokens
        self._kv_demand = KvDemand(
            # No pool (hf) or no prefix cache: each request holds its whole prompt's blocks itself.
            hash_namespace=hash_namespace if kv_blocks_total and config.shares_prefix_blocks else None,
            block_size_tokens=self._block_size_tokens,
            max_batched_tokens=config.max_batched_tokens,
        )
        self._clock = clock
        self._spread = spread
        self.num_requests_in_flight = 0
        self.num_waiting_requests = 0
        self.num_waiting_prompt_tokens = 0
        self.num_sequences_in_flight = 0
        self.num_output_tokens_left = 0  # at most, over every sequence in flight
        # Monotonic counts of prompt tokens to prefill: admitted, and of requests that started
        # (or ended while waiting). Their difference is num_waiting_prompt_tokens.
        self._num_prompt_tokens_admitted = 0
        self._num_prompt_tokens_started = 0
        self._deadline_bound: set[Admitted] = set()  # in flight, with a deadline
        # The most decode steps any request admitted so far asks for (max_tokens): a bound on
        # any in-flight request's steps left, for the check that skips far deadlines.
        self._max_decode_steps = 0
        now_ns = clock()
        self.pace = StepPace(now_ns)
        self.kv_drain = DrainMeter(now_ns)  # blocks per second
        self.sequence_finishes = DrainMeter(now_ns)  # sequences per second
        self.step_times = StepTimeModel()
        self._has_drained = False  # else a slow first step measures a drain of 0: a 30 s hint
        self._last_step_s = 0.0  # the wall time of the last step reported,
        self._last_step_ended_ns = now_ns  # and when its report came

    @property
    def num_kv_blocks_demanded(self) -> int:
        return self._kv_demand.num_blocks

    # --- admission --------------------------------------------------------------------------

    def admit(self, request: EngineRequest) -> Admitted:
        """Count the request in flight and return what it was charged with, or raise (nothing
        counted): InvalidArgument if it exceeds a whole budget, ResourceExhausted if over one
        now, DeadlineExceeded if its deadline cannot be met."""
        now_ns = self._clock()
        was_busy = self.num_requests_in_flight > 0
        self.kv_drain.advance(now_ns, was_busy=was_busy)
        self.sequence_finishes.advance(now_ns, was_busy=was_busy)
        demand = self._kv_demand.of(request)
        self._check_fits_alone(len(request.prompt_token_ids), demand.num_kv_blocks)
        if request.deadline_ns:
            # Before the budgets: a request whose deadline the queue ahead already rules out is
            # told so (DEADLINE_EXCEEDED: a retry keeps the deadline, so a budget's hint to come
            # back once the queue has turned over would only bring it back to be refused).
            self._check_deadline(request, demand, now_ns)
        self._check_budgets(demand, now_ns)
        if self._deadline_admission and self._deadline_bound:
            self._check_admitted_deadlines(request, demand.num_prompt_tokens_to_prefill, now_ns)
        if not self.num_requests_in_flight:  # an idle replica: no step in progress
            self.pace.start(now_ns)
            self._last_step_s = 0.0
        self.num_requests_in_flight += 1
        self.num_waiting_requests += 1
        self.num_waiting_prompt_tokens += demand.num_prompt_tokens_to_prefill
        self._num_prompt_tokens_admitted += demand.num_prompt_tokens_to_prefill
        self._kv_demand.add(demand)
        self.num_sequences_in_flight += request.sampling.n
        sampling = request.sampling
        self.num_output_tokens_left += sampling.n * sampling.max_tokens
        admitted = Admitted(
            demand, request.deadline_ns, sampling.n, sampling.n * sampling.max_tokens, self._num_prompt_tokens_admitted
        )
        if request.deadline_ns:
            self._deadline_bound.add(admitted)
        self._max_decode_steps = max(self._max_decode_steps, admitted.num_decode_steps_left)
        return admitted

    def _check_fits_alone(self, num_prompt_tokens: int, num_kv_blocks: int) -> None:
        if num_prompt_tokens > self.max_waiting_prompt_tokens:
            raise InvalidArgument(
                "prompt_token_ids",
                f"{num_prompt_tokens} tokens exceed this replica's waiting prompt-token budget of "
                f"{self.max_waiting_prompt_tokens} (--max-waiting-prompt-tokens)",
            )
        if self._max_kv_blocks and num_kv_blocks > self._max_kv_blocks:
            raise InvalidArgument(
                "sampling.max_tokens",
                f"the request needs {num_kv_blocks} KV blocks of {self._block_size_tokens} tokens at its full "
                f"length (prompt + n x max_tokens) but this replica admits at most {self._max_kv_blocks} "
                f"(the pool x --kv-overcommit {self.kv_overcommit:g})",
            )

    def _check_budgets(self, demand: RequestDemand, now_ns: int) -> None:
        num_prompt_tokens, num_kv_blocks = demand.num_prompt_tokens_to_prefill, demand.num_new_kv_blocks
        queue_turnover_ms = self._queue_turnover_ms(now_ns)
        if self.num_waiting_requests + 1 > self.max_waiting_requests:
            _refuse(
                f"{self.num_waiting_requests} requests are waiting, the most this replica queues "
                f"(--max-waiting-requests {self.max_waiting_requests})",
                queue_turnover_ms,
            )  # fmt: skip
        if self.num_waiting_prompt_tokens + num_prompt_tokens > self.max_waiting_prompt_tokens:
            _refuse(
                f"{self.num_waiting_prompt_tokens} prompt tokens are waiting and this request brings "
                f"{num_prompt_tokens}, over the budget of {self.max_waiting_prompt_tokens} "
                f"(--max-waiting-prompt-tokens)",
                queue_turnover_ms,
            )  # fmt: skip
        num_reserve_blocks = self._kv_demand.twin_reserve_blocks(demand)
        excess_blocks = self.num_kv_blocks_demanded + num_kv_blocks + num_reserve_blocks - self._max_kv_blocks
        if self._max_kv_blocks and excess_blocks > 0:
            reserve = f" and {num_reserve_blocks} kept free for twins" if num_reserve_blocks else ""
            _refuse(
                f"admitted requests will need {self.num_kv_blocks_demanded} KV blocks and this one "
                f"{num_kv_blocks}{reserve}, over the {self._max_kv_blocks} this replica admits (the pool x "
                f"--kv-overcommit {self.kv_overcommit:g})",
                self._retry_after_ms(excess_blocks, self.kv_drain.per_s if self._has_drained else None, now_ns),
            )  # fmt: skip

    def _queue_turnover_ms(self, now_ns: int) -> int:
        """When the waiting requests will have started: their prompt tokens computed in full steps
        timed by the step-time fit, and the sequences beyond the running batch finished at the
        measured rate. Before the fit has a prompt step, at the prefill pace. (The pace alone,
        an average over warm-up steps that were mostly decodes, hinted 10-30 s on an H200 whose
        queue of 256 requests started within 2 s.)"""
        fit = self.step_times.fit
        if fit is None or not fit.per_prompt_token_s:
            return self._retry_after_ms(self.num_waiting_prompt_tokens, self.pace.prefill_tokens_per_s, now_ns)
        schedule = self._schedule(self.num_sequences_in_flight, self.num_waiting_prompt_tokens, now_ns)
        return _clamped_ms(self._spread(1000 * max(schedule.time_s(schedule.num_full_steps), self._slot_wait_s(fit))))

    def _slot_wait_s(self, fit: StepFit) -> float:
        """How long the sequences beyond the running batch wait for a slot: a batch's worth of
        them waits about the mean decode steps a sequence in flight has left, timed by the fit.
        (A finish rate measured at another load, e.g. a warm-up of a few requests, hinted 10-15 s
        on an H200 whose whole burst of 500 short requests ran in 2 s.)"""
        beyond_batch = max(0, self.num_sequences_in_flight - self.max_num_seqs)
        if not beyond_batch:
            return 0.0
        mean_steps_left = self.num_output_tokens_left / self.num_sequences_in_flight
        return beyond_batch / self.max_num_seqs * mean_steps_left * fit.decode_step_s(self.max_num_seqs)

    def _retry_after_ms(self, amount: float, drain_per_s: float | None, now_ns: int) -> int:
        """When `amount` will have drained at `drain_per_s`, spread and clamped to a useful hint."""
        if drain_per_s is None:
            running_step_ms = 1000 * self.pace.running_step_s(now_ns) if self.num_requests_in_flight else 0
            return _clamped_ms(self._spread(max(DEFAULT_RETRY_AFTER_MS, running_step_ms)))
        return _clamped_ms(self._spread(1000 * amount / drain_per_s) if drain_per_s > 0 else MAX_RETRY_AFTER_MS)

    def _check_deadline(self, request: EngineRequest, demand: RequestDemand, now_ns: int) -> None:
        time_left_s = (request.deadline_ns - now_ns) / 1e9
        if time_left_s <= 0:
            raise DeadlineExceeded(f"the deadline passed {-time_left_s:.3f} s before admission")
        if not self._deadline_admission:
            return
        estimate = self._finish_estimate(request, demand.num_prompt_tokens_to_prefill, now_ns)
        if estimate.total_s > _promised_s(time_left_s):
            raise DeadlineExceeded(
                f"the request cannot finish in the {time_left_s:.2f} s its deadline leaves (less "
                f"{DEADLINE_SLACK:.0%} kept for the estimate's error): estimated {estimate.total_s:.2f} s "
                f"({estimate.describe()})",
                retry_after_ms=self._deadline_retry_after_ms(estimate, time_left_s),
                error_info=estimate.error_info(time_left_s),
            )

    def _deadline_retry_after_ms(self, estimate: FinishEstimate, time_left_s: float) -> int | None:
        """When a retry of this call would fit, or None when no wait would do.

        A retry keeps the call's deadline (grpc's retries, and a client that retries inside
        its first attempt's deadline): waiting h seconds drains the start wait by h but also
        takes h from the time left, of which the estimate may use (1 - DEADLINE_SLACK). So the
        retry fits from h = excess / DEADLINE_SLACK on, as long as the start wait lasts that
        long (past it only the request's own work is left, which the shrinking time left
        stops fitting by T - alone / (1 - DEADLINE_SLACK)). Before (the hint was when a
        request with a fresh budget would fit: the excess itself), every refused client of a
        burst came back to be refused again: 2,073-2,634 attempts for 500 requests on a 2-core
        CPU, whose CPU then made 21-29 admitted requests miss their deadlines
        (docs/reliability.md). The refusal's ErrorInfo still carries the estimate, for a
        client that resubmits with a fresh budget."""
        earliest_s = (estimate.total_s - _promised_s(time_left_s)) / DEADLINE_SLACK
        if earliest_s > estimate.total_s - estimate.alone_s:
            return None
        latest_s = time_left_s - estimate.alone_s / (1 - DEADLINE_SLACK)
        return _clamped_ms(1000 * self._spread_after(earliest_s, latest_s))

    def _spread_after(self, earliest_s: float, latest_s: float) -> float:
        """A hint spread like the others but never before `earliest_s` (sooner is refused
        again): between 1x and 1.5x of it, and not past `latest_s`."""
        spread_s = self._spread(1000 * earliest_s) / 1000  # 0.5x-1.5x of it
        return min(latest_s, earliest_s + abs(spread_s - earliest_s))

    def _check_admitted_deadlines(self, request: EngineRequest, num_prompt_tokens: int, now_ns: int) -> None:
        """Refuse a request whose prefill and place in the batch would make a request admitted
        before it miss a deadline its estimate met without it: a promise kept to the first
        comers, which a burst would otherwise break for all of them. Requests the estimate
        already has missing their deadline do not count (the engine ends them at it)."""
        sequences, queue = self.num_sequences_in_flight, self.num_waiting_prompt_tokens
        with_it = self._schedule(sequences + request.sampling.n, queue + num_prompt_tokens, now_ns)
        if self._cannot_harm_any(with_it, now_ns):
            return
        without = self._schedule(sequences, queue, now_ns)
        harmed: list[tuple[int, int, int]] = []  # (deadline, finish without it, with it), ns
        for admitted in self._deadline_bound:
            finish_ns = now_ns + int(1e9 * without.time_s(self._steps_left(admitted, without)))
            finish_with_ns = now_ns + int(1e9 * with_it.time_s(self._steps_left(admitted, with_it)))
            promised_ns = now_ns + int(1e9 * _promised_s((admitted.deadline_ns - now_ns) / 1e9))
            if finish_ns <= promised_ns < finish_with_ns:
                harmed.append((admitted.deadline_ns, finish_ns, finish_with_ns))
        if harmed:
            deadline_ns, finish_ns, finish_with_ns = min(harmed)
            _refuse(
                f"admitting this request would make {len(harmed)} admitted requests miss their deadlines (the "
                f"nearest in {(deadline_ns - now_ns) / 1e9:.1f} s: estimated to finish in "
                f"{(finish_with_ns - now_ns) / 1e9:.1f} s with it, {(finish_ns - now_ns) / 1e9:.1f} s without)",
                _clamped_ms(self._spread((finish_ns - now_ns) / 1e6)),
            )  # fmt: skip

    def _cannot_harm_any(self, with_it: StepSchedule, now_ns: int) -> bool:
        """Whether even the admitted request with the nearest deadline keeps it with the new one
        admitted, by a bound on every in-flight request's steps left (the most decode steps any
        asked for, after the whole waiting queue's prefill). Why: the check per admitted request
        is O(in flight), so a burst of 256 requests that all carry a far deadline (a client's
        600 s timeout) cost the server's event loop 0.8 ms per admission at the end of it, 123 ms
        in all on the 2-core machine (bench/bench_admission.py), while the requests waited to
        reach the engine."""
        horizon_steps = self._max_decode_steps + with_it.steps_to_prefill(self.num_waiting_prompt_tokens)
        earliest_ns = min(admitted.deadline_ns for admitted in self._deadline_bound)
        return _promised_s((earliest_ns - now_ns) / 1e9) > with_it.time_s(horizon_steps) + 1e-3

    def _steps_left(self, admitted: Admitted, schedule: StepSchedule) -> int:
        """The steps until an in-flight request's last token, by `schedule`."""
        steps = admitted.num_decode_steps_left
        if admitted.is_waiting:  # its prefill's last step samples its first token
            ahead = min(self.num_waiting_prompt_tokens, max(0, admitted.queue_end - self._num_prompt_tokens_started))
            steps += schedule.steps_to_prefill(ahead) - 1
        return max(0, steps)

    def finish_estimate(self, request: EngineRequest) -> FinishEstimate:
        """How long the request would take if admitted now, from what is measured so far."""
        num_prompt_tokens_to_prefill = self._kv_demand.of(request).num_prompt_tokens_to_prefill
        return self._finish_estimate(request, num_prompt_tokens_to_prefill, self._clock())

    def _finish_estimate(self, request: EngineRequest, num_prompt_tokens_to_prefill: int, now_ns: int) -> FinishEstimate:
        n, max_tokens = request.sampling.n, request.sampling.max_tokens
        sequences_joined = self.num_sequences_in_flight + n
        prompt_tokens_ahead = self.num_waiting_prompt_tokens + num_prompt_tokens_to_prefill
        alone = self._schedule(n, num_prompt_tokens_to_prefill)
        return FinishEstimate(
            schedule=self._schedule(sequences_joined, prompt_tokens_ahead, now_ns),
            prompt_tokens_ahead=prompt_tokens_ahead,
            max_tokens=max_tokens,
            batch=min(self.max_num_seqs, sequences_joined),
            sequences_beyond_batch=max(0, sequences_joined - self.max_num_seqs),
            sequence_finishes_per_s=self.sequence_finishes.per_s,
            alone_s=alone.time_s(alone.steps_to_prefill(num_prompt_tokens_to_prefill) + max_tokens - 1),
        )

    def _schedule(self, num_sequences: int, num_waiting_prompt_tokens: int, now_ns: int | None = None) -> StepSchedule:
        """The steps ahead with this many sequences in flight and prompt tokens waiting, timed by
        the fit of this replica's own steps (0 before any: a cold replica admits); at `now_ns`,
        after the step in progress (None: on an idle replica)."""
        batch = min(self.max_num_seqs, num_sequences)
        chunk = max(1, self._max_batched_tokens - batch)
        num_full_steps = math.ceil(num_waiting_prompt_tokens / chunk)
        fit = self.step_times.fit
        if fit is None:
            return StepSchedule(0.0, 0.0, 0.0, chunk, num_full_steps)
        in_progress_s = 0.0 if now_ns is None else self._step_in_progress_s(now_ns)
        # The last full step computes what is left of the queue (a queue shorter than a chunk,
        # only that much): priced as a whole chunk, 3 tokens past 4 chunks cost a 5 s step on
        # the CPU and refused a request that would have finished in 26 of its 30 s.
        last_chunk = num_waiting_prompt_tokens - (num_full_steps - 1) * chunk if num_full_steps else 0
        return StepSchedule(
            fit.step_s(batch, batch + chunk), fit.step_s(batch, batch + last_chunk), fit.step_s(batch, batch),
            chunk, num_full_steps, in_progress_s,
        )  # fmt: skip

    def _step_in_progress_s(self, now_ns: int) -> float:
        """What is left of the step running now, if it is as long as the last one."""
        if not self.num_requests_in_flight:
            return 0.0
        return max(0.0, self._last_step_s - (now_ns - self._last_step_ended_ns) / 1e9)

    # --- learning from outputs and steps ----------------------------------------------------

    def observe_steps(self, steps: list[StepReport]) -> None:
        for step in steps:
            self.step_times.add(step.wall_s, step.num_seqs, step.num_tokens)
        if steps:
            self._last_step_s, self._last_step_ended_ns = steps[-1].wall_s, self._clock()

    def observe(self, deliveries: list[tuple[Admitted, EngineOutput, bool]]) -> None:
        """Account one delivery of outputs (in the order the core produced them), each with what
        its request was admitted with and whether it is the request's last."""
        now_ns = self._clock()
        was_busy = self.num_requests_in_flight > 0
        self.kv_drain.advance(now_ns, was_busy=was_busy)
        self.sequence_finishes.advance(now_ns, was_busy=was_busy)
        num_started_prompt_tokens, num_released_blocks, num_token_outputs, num_finished = 0, 0, 0, 0
        for admitted, output, is_last in deliveries:
            num_token_outputs += bool(output.new_token_ids)
            admitted.num_tokens_left -= len(output.new_token_ids)
            self.num_output_tokens_left -= len(output.new_token_ids)
            demand = admitted.demand
            if admitted.is_waiting and (output.new_token_ids or output.is_finished):
                admitted.is_waiting = False
                self.num_waiting_requests -= 1
                self.num_waiting_prompt_tokens -= demand.num_prompt_tokens_to_prefill
                self._num_prompt_tokens_started += demand.num_prompt_tokens_to_prefill
                admitted.has_started = bool(output.new_token_ids)  # else aborted or failed while waiting
                self._kv_demand.stop_waiting(demand, has_started=admitted.has_started)
                if admitted.has_started:
                    num_started_prompt_tokens += demand.num_prompt_tokens_to_prefill
            if output.is_finished:
                self.num_sequences_in_flight -= 1
                num_finished += 1
            if is_last:
                self.num_output_tokens_left -= max(0, admitted.num_tokens_left)  # ended before max_tokens
                self.num_requests_in_flight -= 1
                self._deadline_bound.discard(admitted)
                num_released_blocks += self._kv_demand.remove(demand, has_started=admitted.has_started)
        self.kv_drain.add(num_released_blocks)
        self.sequence_finishes.add(num_finished)
        self._has_drained = self._has_drained or num_released_blocks > 0
        self.pace.advance(
            now_ns, num_token_outputs=num_token_outputs, num_started_prompt_tokens=num_started_prompt_tokens
        )


def _refuse(budget: str, retry_after_ms: int) -> None:
    raise ResourceExhausted(f"replica busy: {budget}; retry in ~{retry_after_ms} ms", retry_after_ms=retry_after_ms)


def _promised_s(time_left_s: float) -> float:
    """Of the time a deadline leaves, what an estimate may take and the deadline count as met."""
    return (1 - DEADLINE_SLACK) * time_left_s


def _clamped_ms(ms: float) -> int:
    return int(min(MAX_RETRY_AFTER_MS, max(MIN_RETRY_AFTER_MS, ms)))

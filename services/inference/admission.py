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

Deadline (EngineRequest.deadline_ns): the estimated time to finish is
  wait    (waiting prompt tokens + its own, both to be prefilled) / prefill rate: the queue
          ahead starts first;
  decode  max_tokens x the step time, scaled up in proportion when the batch it joins (every
          sequence in flight, its own included) is larger than the one the step time was
          measured at: a compute-bound step (CPU; a GPU at large batch) slows with every
          sequence, so admitting by the step time of a smaller batch would let everyone in and
          make the admitted miss their deadlines. Only where the step grows with the batch
          (`step_grows_with_batch`: the CPU): a GPU's decode step streams the weights and
          barely grows (H200, 1.5B: 1.74 ms at 1 sequence, 3.8 ms at 256), and scaling there
          by sequences that produced tokens (few, in prefill-heavy steps) estimated 598 ms for
          a 17 ms step and refused 247 of 384 feasible requests (8B, 256 streams);
and a request whose estimate exceeds the time it has left is refused with DeadlineExceeded at
once, instead of being queued to die. What is not measured yet counts as zero: a cold replica
admits.

Measurements, learnt from the outputs AsyncEngine routes (`observe`, O(1) per output):
  step time, prefill rate  drain_meter.StepPace (the prefill rate: prompt tokens prefilled for
                           requests that produced their first token, per second of the steps
                           that started any);
  KV drain                 blocks of demand released by finished requests (a shared prompt
                           block with its last holder), per second of time in which a request
                           was in flight.
"""

from __future__ import annotations

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
from llmserve.inference.engine.types import EngineRequest
from llmserve.inference.finish_estimate import FinishEstimate
from llmserve.inference.kv_demand import KvDemand, RequestDemand

DEFAULT_RETRY_AFTER_MS = 1000  # before the drain rate is measured
MIN_RETRY_AFTER_MS = 50  # about one step of a busy GPU: sooner would only be refused again
MAX_RETRY_AFTER_MS = 30_000


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The budgets (see EngineConfig's admission flags); the defaults are the flags' on an
    accelerator with the default --max-num-seqs."""

    max_waiting_requests: int = default_max_waiting_requests("cuda", DEFAULT_MAX_NUM_SEQS)
    max_waiting_prompt_tokens: int | None = None  # None: see WAITING_PROMPT_CONTEXTS
    kv_overcommit: float = DEFAULT_KV_OVERCOMMIT
    shares_prefix_blocks: bool = True  # the core's prefix cache is on (where it has a pool)
    max_batched_tokens: int = 2048  # the core's per-step token budget (EngineConfig's default)

    @classmethod
    def of(cls, config: EngineConfig) -> "AdmissionConfig":
        max_waiting_requests = config.max_waiting_requests
        if max_waiting_requests is None:
            max_waiting_requests = default_max_waiting_requests(config.device, config.max_num_seqs)
        return cls(
            max_waiting_requests, config.max_waiting_prompt_tokens, config.kv_overcommit,
            config.enable_prefix_caching, config.max_batched_tokens,
        )  # fmt: skip


@dataclass(slots=True)
class Admitted:
    """The demand one in-flight request was admitted with, and its progress. AsyncEngine keeps
    it with the request (it owns which requests are in flight) and hands it back with each
    output (`observe`)."""

    demand: RequestDemand
    is_waiting: bool = True  # no token produced yet
    has_started: bool = False  # produced a token (not merely ended while waiting)


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
        step_grows_with_batch: bool = True,
        clock: Callable[[], int] = time.monotonic_ns,
    ):
        self.max_waiting_requests = config.max_waiting_requests
        self.max_waiting_prompt_tokens = config.max_waiting_prompt_tokens or max(
            WAITING_PROMPT_CONTEXTS * max_context_tokens,
            WAITING_PROMPT_TOKENS_PER_REQUEST * config.max_waiting_requests,
        )
        self.kv_overcommit = config.kv_overcommit
        self._step_grows_with_batch = step_grows_with_batch
        self._max_kv_blocks = int(kv_blocks_total * config.kv_overcommit)
        self._block_size_tokens = hash_namespace.block_size_tokens
        self._kv_demand = KvDemand(
            # No pool (hf) or no prefix cache: each request holds its whole prompt's blocks itself.
            hash_namespace=hash_namespace if kv_blocks_total and config.shares_prefix_blocks else None,
            block_size_tokens=self._block_size_tokens,
            max_batched_tokens=config.max_batched_tokens,
        )
        self._clock = clock
        self.num_requests_in_flight = 0
        self.num_waiting_requests = 0
        self.num_waiting_prompt_tokens = 0
        self.num_sequences_in_flight = 0
        now_ns = clock()
        self.pace = StepPace(now_ns)
        self.kv_drain = DrainMeter(now_ns)  # blocks per second
        self._has_drained = False  # else a slow first step measures a drain of 0: a 30 s hint

    @property
    def num_kv_blocks_demanded(self) -> int:
        return self._kv_demand.num_blocks

    # --- admission --------------------------------------------------------------------------

    def admit(self, request: EngineRequest) -> Admitted:
        """Count the request in flight and return what it was charged with, or raise (nothing
        counted): InvalidArgument if it exceeds a whole budget, ResourceExhausted if over one
        now, DeadlineExceeded if its deadline cannot be met."""
        now_ns = self._clock()
        self.kv_drain.advance(now_ns, was_busy=self.num_requests_in_flight > 0)
        demand = self._kv_demand.of(request)
        self._check_fits_alone(len(request.prompt_token_ids), demand.num_kv_blocks)
        self._check_budgets(demand, now_ns)
        if request.deadline_ns:
            self._check_deadline(request, demand, now_ns)
        if not self.num_requests_in_flight:
            self.pace.start(now_ns)
        self.num_requests_in_flight += 1
        self.num_waiting_requests += 1
        self.num_waiting_prompt_tokens += demand.num_prompt_tokens_to_prefill
        self._kv_demand.add(demand)
        self.num_sequences_in_flight += request.sampling.n
        return Admitted(demand)

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
        queue_turnover_ms = self._retry_after_ms(self.num_waiting_prompt_tokens, self.pace.prefill_tokens_per_s, now_ns)
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

    def _retry_after_ms(self, amount: float, drain_per_s: float | None, now_ns: int) -> int:
        """When `amount` will have drained at `drain_per_s`, clamped to a useful hint."""
        if drain_per_s is None:
            running_step_ms = 1000 * self.pace.running_step_s(now_ns) if self.num_requests_in_flight else 0
            return _clamped_ms(max(DEFAULT_RETRY_AFTER_MS, running_step_ms))
        return _clamped_ms(1000 * amount / drain_per_s if drain_per_s > 0 else MAX_RETRY_AFTER_MS)

    def _check_deadline(self, request: EngineRequest, demand: RequestDemand, now_ns: int) -> None:
        time_left_s = (request.deadline_ns - now_ns) / 1e9
        if time_left_s <= 0:
            raise DeadlineExceeded(f"the deadline passed {-time_left_s:.3f} s before admission")
        estimate = self._finish_estimate(request, demand.num_prompt_tokens_to_prefill)
        if estimate.total_s > time_left_s:
            raise DeadlineExceeded(
                f"the request cannot finish in the {time_left_s:.1f} s its deadline leaves: estimated "
                f"{estimate.total_s:.1f} s ({estimate.describe()})"
            )

    def finish_estimate(self, request: EngineRequest) -> FinishEstimate:
        """How long the request would take if admitted now, from what is measured so far."""
        return self._finish_estimate(request, self._kv_demand.of(request).num_prompt_tokens_to_prefill)

    def _finish_estimate(self, request: EngineRequest, num_prompt_tokens_to_prefill: int) -> FinishEstimate:
        prompt_tokens_ahead = self.num_waiting_prompt_tokens + num_prompt_tokens_to_prefill
        drain_per_s = self.pace.prefill_tokens_per_s
        wait_s = 0.0 if drain_per_s is None else prompt_tokens_ahead / drain_per_s
        max_tokens = request.sampling.max_tokens
        step_s = self.pace.step_s or 0.0
        if self._step_grows_with_batch and self.pace.batch_size:
            step_s *= max(1.0, (self.num_sequences_in_flight + request.sampling.n) / self.pace.batch_size)
        return FinishEstimate(prompt_tokens_ahead, drain_per_s, wait_s, max_tokens, step_s)

    # --- learning from outputs --------------------------------------------------------------

    def observe(self, deliveries: list[tuple[Admitted, EngineOutput, bool]]) -> None:
        """Account one delivery of outputs (in the order the core produced them), each with what
        its request was admitted with and whether it is the request's last."""
        now_ns = self._clock()
        self.kv_drain.advance(now_ns, was_busy=self.num_requests_in_flight > 0)
        num_started_prompt_tokens, num_released_blocks, num_token_outputs = 0, 0, 0
        for admitted, output, is_last in deliveries:
            num_token_outputs += bool(output.new_token_ids)
            demand = admitted.demand
            if admitted.is_waiting and (output.new_token_ids or output.is_finished):
                admitted.is_waiting = False
                self.num_waiting_requests -= 1
                self.num_waiting_prompt_tokens -= demand.num_prompt_tokens_to_prefill
                admitted.has_started = bool(output.new_token_ids)  # else aborted or failed while waiting
                self._kv_demand.stop_waiting(demand, has_started=admitted.has_started)
                if admitted.has_started:
                    num_started_prompt_tokens += demand.num_prompt_tokens_to_prefill
            if output.is_finished:
                self.num_sequences_in_flight -= 1
            if is_last:
                self.num_requests_in_flight -= 1
                num_released_blocks += self._kv_demand.remove(demand, has_started=admitted.has_started)
        self.kv_drain.add(num_released_blocks)
        self._has_drained = self._has_drained or num_released_blocks > 0
        self.pace.advance(
            now_ns, num_token_outputs=num_token_outputs, num_started_prompt_tokens=num_started_prompt_tokens
        )


def _refuse(budget: str, retry_after_ms: int) -> None:
    raise ResourceExhausted(f"replica busy: {budget}; retry in ~{retry_after_ms} ms", retry_after_ms=retry_after_ms)


def _clamped_ms(ms: float) -> int:
    return int(min(MAX_RETRY_AFTER_MS, max(MIN_RETRY_AFTER_MS, ms)))

"""AdmissionController: budgets, retry hints from measured rates, deadline refusals.

Time is a clock the test advances, so every rate and hint is exact. The controller is driven as
AsyncEngine drives it (`Owner`): the record `admit` returns is kept with the request and handed
back with each of its outputs, marked on the request's last.
"""

from __future__ import annotations

import collections
import random
import zlib

import pytest

from llmserve.block_hash import HASH_VERSION, HashNamespace
from llmserve.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from llmserve.inference.admission import (
    DEADLINE_SLACK,
    DEFAULT_RETRY_AFTER_MS,
    MAX_RETRY_AFTER_MS,
    MIN_RETRY_AFTER_MS,
    AdmissionConfig,
    SPREAD_HIGH,
    SPREAD_LOW,
    AdmissionConfig,
    AdmissionController,
    Admitted,
    Spread,
    jittered,
)
from llmserve.engine_output import EngineOutput
from llmserve.inference.engine.types import EngineRequest, StepReport
from llmserve.inference.finish_estimate import DEADLINE_ESTIMATE_REASON
from llmserve.inference.kv_demand import kv_blocks_needed, prompt_block_hashes
from llmserve.sampling import FinishReason, SamplingParams

BLOCK = 16
NAMESPACE = HashNamespace(model_fingerprint=1, tokenizer_fingerprint=2, block_size_tokens=BLOCK)
CONTEXT = 1024
S = 1_000_000_000  # ns per second
SYSTEM_PROMPT = list(range(50_000, 50_000 + 40 * BLOCK))


class Clock:
    def __init__(self):
        self.now_ns = 1000 * S  # monotonic time is far from 0, the "no deadline" value

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * S)


class Owner:
    """The controller with the requests' owner beside it, as AsyncEngine keeps them: each
    admitted request's record and its sequences without a final output."""

    def __init__(self, admission: AdmissionController):
        self.admission = admission
        self._in_flight: dict[str, tuple[Admitted, set[int]]] = {}

    def admit(self, request: EngineRequest) -> None:
        admitted = self.admission.admit(request)
        self._in_flight[request.request_id] = (admitted, set(range(request.sampling.n)))

    def observe(self, outputs: list[EngineOutput]) -> None:
        deliveries = []
        for output in outputs:
            admitted, open_sequences = self._in_flight[output.request_id]
            if output.is_finished:
                open_sequences.discard(output.sequence_index)
            is_last = output.is_finished and not open_sequences
            if is_last:
                del self._in_flight[output.request_id]
            deliveries.append((admitted, output, is_last))
        self.admission.observe(deliveries)

    def __getattr__(self, name: str):
        return getattr(self.admission, name)


def controller(clock: Clock, *, kv_blocks_total: int = 0, spread: Spread = lambda ms: ms, **budgets) -> Owner:
    """Hints unspread unless `spread` says otherwise: each test computes them exactly."""
    return Owner(AdmissionController(
        AdmissionConfig(**budgets), kv_blocks_total=kv_blocks_total, hash_namespace=NAMESPACE,
        max_context_tokens=CONTEXT, clock=clock, spread=spread,
    ))  # fmt: skip


def steps(admission, *batches: tuple[float, int, int]) -> None:
    """StepReports (duration_s, sequences, tokens) as the core sends them."""
    admission.observe_steps([StepReport(*batch) for batch in batches])


def request(
    request_id: str, num_prompt_tokens: int, max_tokens: int = 8, *, n: int = 1, deadline_ns: int = 0,
    num_shared_tokens: int = 0, cache_salt: str = "",
):  # fmt: skip
    """A prompt of its own (its tokens named by its id) after the first `num_shared_tokens` of
    SYSTEM_PROMPT."""
    own_token_id = zlib.crc32(request_id.encode()) % 50_000
    prompt = SYSTEM_PROMPT[:num_shared_tokens] + [own_token_id] * (num_prompt_tokens - num_shared_tokens)
    sampling = SamplingParams(max_tokens=max_tokens, n=n)
    return EngineRequest(request_id, prompt, sampling, arrival_ns=0, deadline_ns=deadline_ns, cache_salt=cache_salt)


def token(request_id: str, sequence_index: int = 0) -> EngineOutput:
    return EngineOutput(request_id, sequence_index, [7])


def finished(request_id: str, sequence_index: int = 0) -> EngineOutput:
    return EngineOutput(request_id, sequence_index, [7], finish_reason=FinishReason.LENGTH)


def test_kv_demand_counts_shared_prompt_blocks_once():
    # 40 prompt tokens: 2 full blocks shared; each of 3 sequences grows to 50 tokens = 4 blocks.
    assert kv_blocks_needed(request("r", 40, 10, n=3), BLOCK) == 2 + 3 * 2
    assert kv_blocks_needed(request("r", 32, 1), BLOCK) == 3


def test_waiting_requests_over_the_budget_are_refused_until_one_starts():
    clock = Clock()
    admission = controller(clock, max_waiting_requests=2)
    admission.admit(request("a", 10))
    admission.admit(request("b", 10))
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("c", 10))
    assert "2 requests are waiting" in refused.value.message and "--max-waiting-requests 2" in refused.value.message
    assert refused.value.retry_after_ms == DEFAULT_RETRY_AFTER_MS  # nothing measured yet
    admission.observe([token("a")])
    admission.admit(request("c", 10))
    assert admission.num_waiting_requests == 2


def test_retry_hint_is_the_queue_turnover_at_the_measured_prefill_rate():
    clock = Clock()
    admission = controller(clock, max_waiting_prompt_tokens=100)
    admission.admit(request("a", 60))
    clock.advance(0.5)
    admission.observe([token("a")])  # 60 prompt tokens started in a 0.5 s step: 120/s
    assert admission.pace.prefill_tokens_per_s == pytest.approx(120)
    admission.admit(request("b", 80))
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("c", 40))
    # the 80 waiting prompt tokens start in 2/3 s: then the queue has room again
    assert refused.value.retry_after_ms == 666
    assert "80 prompt tokens are waiting" in refused.value.message and "budget of 100" in refused.value.message


def test_once_prompt_steps_are_measured_the_queue_turnover_is_their_full_steps():
    """The waiting prompt tokens in full steps timed by the step-time fit: the 2,000 waiting
    tokens fit one step of (budget - batch) prompt tokens, at 5 ms each + the decode line."""
    clock = Clock()
    admission = controller(clock, max_waiting_requests=2, max_batched_tokens=2048)
    steps(admission, (0.010, 2, 2), (0.020, 4, 4), (0.005 * 1000 + 0.010, 2, 1002))  # 5 ms per prompt token
    admission.admit(request("a", 1000))
    admission.admit(request("b", 1000))
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("c", 10))
    fit = admission.step_times.fit
    chunk = 2048 - 2
    full_step_s = fit.decode_step_s(2) + fit.per_prompt_token_s * min(chunk, 2000)
    assert refused.value.retry_after_ms == int(1000 * full_step_s)  # 2000 tokens: one full step
    assert 9.5 < full_step_s < 10.5


def test_sequences_beyond_the_batch_wait_the_mean_steps_left_of_those_in_flight():
    """A burst of short requests past --max-num-seqs: a batch's worth beyond it waits for the
    decode steps a sequence in flight has left (8 tokens), not for a finish rate measured at
    another load."""
    clock = Clock()
    admission = controller(clock, max_waiting_requests=4, max_num_seqs=2, max_batched_tokens=2048)
    steps(admission, (0.010, 2, 2), (0.020, 4, 4), (0.001 * 100 + 0.010, 2, 102))
    for name in "abcd":
        admission.admit(request(name, 1, max_tokens=8))  # 1-token prompts: prefill is nothing
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("e", 1, max_tokens=8))
    fit = admission.step_times.fit
    # 4 sequences in flight, 2 beyond the batch of 2: one batch's worth waits 8 steps of the batch.
    assert refused.value.retry_after_ms == int(1000 * 8 * fit.decode_step_s(2))
    admission.observe([token(name) for name in "abcd"])  # one token each: 7 left
    admission.admit(request("e", 1, max_tokens=8))
    assert admission.num_output_tokens_left == 4 * 7 + 8


def test_idle_time_and_steps_that_start_nothing_leave_the_prefill_rate_alone():
    clock = Clock()
    admission = controller(clock)
    clock.advance(100)  # idle
    admission.admit(request("a", 50))
    clock.advance(0.25)
    admission.observe([token("a")])
    assert admission.pace.prefill_tokens_per_s == pytest.approx(200)
    admission.admit(request("b", 50))  # mid-step: it starts in the next one
    clock.advance(0.25)
    admission.observe([token("a")])
    assert admission.pace.prefill_tokens_per_s == pytest.approx(200)


def test_before_any_measurement_the_hint_is_at_least_the_step_in_progress():
    clock = Clock()
    admission = controller(clock, max_waiting_requests=1)
    admission.admit(request("a", 10))
    clock.advance(3.0)  # a slow engine's first step, not over yet
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("b", 10))
    assert refused.value.retry_after_ms == 3000


def test_kv_demand_over_the_pool_is_refused_until_a_request_finishes():
    clock = Clock()
    admission = controller(clock, kv_blocks_total=10)
    admission.admit(request("a", 48, 48))  # 6 blocks at full length
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("b", 48, 48))
    assert "need 6 KV blocks and this one 6, over the 10" in refused.value.message
    clock.advance(2.0)
    admission.observe([finished("a")])  # 6 blocks released over 2 s in flight: 3 blocks/s
    admission.admit(request("b", 48, 48))
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("c", 48, 48))
    assert refused.value.retry_after_ms == 666  # 2 blocks too many at 3 blocks/s
    assert admission.num_kv_blocks_demanded == 6


def test_until_a_request_has_finished_the_kv_drain_is_unmeasured():
    clock = Clock()
    admission = controller(clock, kv_blocks_total=10)
    admission.admit(request("a", 48, 48))
    clock.advance(1.0)
    admission.observe([token("a")])  # a slow first step: 1 s in flight, no block released yet
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("b", 48, 48))
    assert refused.value.retry_after_ms == DEFAULT_RETRY_AFTER_MS  # not MAX_RETRY_AFTER_MS


def test_overcommit_scales_the_kv_budget():
    admission = controller(Clock(), kv_blocks_total=10, kv_overcommit=2.0)
    for request_id in "abc":
        admission.admit(request(request_id, 48, 48))
    with pytest.raises(ResourceExhausted):
        admission.admit(request("d", 48, 48))


def test_a_request_over_a_whole_budget_is_invalid_not_retryable():
    admission = controller(Clock(), kv_blocks_total=10, max_waiting_prompt_tokens=100)
    with pytest.raises(InvalidArgument) as too_long:
        admission.admit(request("a", 101))
    assert too_long.value.field == "prompt_token_ids" and too_long.value.retry_after_ms is None
    with pytest.raises(InvalidArgument) as too_big:
        admission.admit(request("b", 100, 100))  # 13 blocks
    assert too_big.value.field == "sampling.max_tokens" and "13 KV blocks" in too_big.value.problem
    assert admission.num_waiting_requests == 0 and admission.num_kv_blocks_demanded == 0


def test_a_request_ends_when_its_last_sequence_does():
    admission = controller(Clock(), kv_blocks_total=100)
    admission.admit(request("a", 20, 10, n=2))
    admission.observe([token("a", 0), token("a", 1)])
    assert admission.num_waiting_requests == 0 and admission.num_waiting_prompt_tokens == 0
    admission.observe([finished("a", 1)])
    assert admission.num_kv_blocks_demanded == kv_blocks_needed(request("a", 20, 10, n=2), BLOCK)
    admission.observe([finished("a", 0)])
    assert admission.num_kv_blocks_demanded == 0


def test_a_cold_replica_admits_any_deadline_still_ahead():
    clock = Clock()
    admission = controller(clock)
    admission.admit(request("a", 500, 500, deadline_ns=clock.now_ns + 1))
    with pytest.raises(DeadlineExceeded, match="passed"):
        admission.admit(request("b", 10, deadline_ns=clock.now_ns))


def cpu_like_steps(admission) -> None:
    """A CPU's steps: 80 ms + 10 ms per sequence + 0.1 ms per token, at batches 1 to 4, decode
    steps and steps with prompt chunks of 500 and 1000 tokens (they grow with both)."""
    steps(admission, *[
        (0.08 + 0.01 * batch + 0.0001 * tokens, batch, tokens)
        for batch in (1, 2, 3, 4) for tokens in (batch, batch + 500, batch + 1000)
    ] * 3)  # fmt: skip


def test_a_deadline_the_measured_steps_cannot_meet_is_refused_at_once():
    clock = Clock()
    admission = controller(clock)
    admission.admit(request("a", 100, 100))
    cpu_like_steps(admission)
    clock.advance(1)  # the last step reported a second ago: nothing of it is left
    admission.admit(request("b", 400))  # 500 prompt tokens waiting
    # In the batch of 3 it joins: one full step computes the 600 prompt tokens (its own last),
    # 80 + 30 + 60.3 ms, and samples its first token; 49 decode steps of 80 + 30 + 0.3 ms follow
    estimate = admission.finish_estimate(request("c", 100, 50))
    assert estimate.batch == 3 and estimate.prefill_steps == 1
    assert estimate.prefill_wait_s == pytest.approx(0.1703, rel=1e-3)
    assert estimate.total_s == pytest.approx(0.1703 + 49 * 0.1103, rel=1e-3)
    with pytest.raises(DeadlineExceeded) as refused:
        admission.admit(request("c", 100, 50, deadline_ns=clock.now_ns + 5 * S))
    assert "estimated 5.57 s" in refused.value.message and "1 steps" in refused.value.message
    # 6 s: the estimate ends within it, but not DEADLINE_SLACK of it before (5.4 s)
    with pytest.raises(DeadlineExceeded):
        admission.admit(request("c", 100, 50, deadline_ns=clock.now_ns + 6 * S))
    admission.admit(request("c", 100, 50, deadline_ns=clock.now_ns + 65 * S // 10))


def test_while_prompts_wait_every_step_is_a_full_one_for_the_decodes_too():
    clock = Clock()
    admission = controller(clock, max_batched_tokens=1000)
    cpu_like_steps(admission)
    admission.admit(request("a", 100))
    admission.admit(request("b", 9000))
    # 9101 prompt tokens, 997 a step (the budget less 3 decodes): 9 full steps of 1000 tokens
    # (80 + 30.3 + 99.7 ms), the 10th computes the 128 left (80 + 30.3 + 12.8 ms); its prompt
    # ends in the 10th, its 5 other tokens in the decode steps after it
    estimate = admission.finish_estimate(request("c", 1, 6))
    assert estimate.schedule.num_full_steps == 10 and estimate.prefill_steps == 10
    assert estimate.total_s == pytest.approx(9 * 0.21 + 0.1231 + 5 * 0.1103, rel=1e-3)
    # A short prompt behind no queue: its decode steps are decode steps from the start
    assert admission.finish_estimate(request("c", 1, 6)).schedule.decode_step_s == pytest.approx(0.1103, rel=1e-3)


def test_a_request_that_would_make_an_earlier_one_miss_its_deadline_waits():
    clock = Clock()
    admission = controller(clock, max_batched_tokens=1000)
    cpu_like_steps(admission)
    # a alone: a full step of 101 tokens (100.1 ms), 9 decode steps of 90.1 ms: 0.911 s of its 2 s
    admission.admit(request("a", 100, 10, deadline_ns=clock.now_ns + 2 * S))
    # b's 4000 prompt tokens make a's 10 steps 4 full ones (200 ms), the 5th with the 108 tokens
    # left (111 ms) and 5 decode ones (100.2 ms): 1.412 s, still in time
    admission.admit(request("b", 4000))
    # c's 8000 more would make all 10 full ones (210 ms): 2.1 s, past a's deadline
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("c", 8000))
    assert "would make 1 admitted requests miss their deadlines" in refused.value.message
    assert abs(refused.value.retry_after_ms - 1412) <= 1  # when a will have finished
    # a request already estimated to miss its deadline is not protected: the engine ends it
    clock.advance(1.9)
    admission.admit(request("c", 8000))


def test_the_batch_a_request_joins_is_at_most_max_num_seqs_and_the_excess_waits_for_finishes():
    clock = Clock()
    admission = controller(clock, max_num_seqs=4)
    cpu_like_steps(admission)
    admission.admit(request("p", 1000, 100))
    clock.advance(0.1)
    admission.observe([token("p")])
    for name in "abcdef":
        admission.admit(request(name, 1, 100))
    clock.advance(1.0)
    admission.observe([finished("a"), finished("b")])  # 2 sequences finished in 1.1 s busy
    # 5 in flight + its own = 6, two beyond the batch of 4: 1.1 s for two to finish, while one
    # full step computes the 5 prompt tokens waiting, then 9 decode steps of the batch of 4
    estimate = admission.finish_estimate(request("g", 1, 10))
    assert estimate.batch == 4 and estimate.sequences_beyond_batch == 2
    assert estimate.prefill_wait_s == pytest.approx(0.1209, rel=1e-3)
    assert estimate.slot_wait_s == pytest.approx(1.1) and estimate.start_s == estimate.slot_wait_s
    assert estimate.total_s == pytest.approx(1.1 + 9 * 0.1204, rel=1e-3)


def test_a_step_that_does_not_grow_with_the_batch_is_the_estimate_for_any_batch():
    clock = Clock()
    admission = controller(clock)
    steps(admission, *[(0.004, batch, batch) for batch in (1, 8, 64, 256)] * 5)  # a GPU's decode
    for name in "abcdefgh":
        admission.admit(request(name, 1, 100))
    assert admission.finish_estimate(request("i", 1, 50)).total_s == pytest.approx(50 * 0.004, rel=1e-3)


def test_the_steps_ahead_start_after_what_is_left_of_the_step_in_progress():
    """Admitted mid-step, a request's prompt waits for that step to end: taken as long as the
    last step reported (a decode step of the batch of 1: 80 + 10 + 0.1 ms), less what has run."""
    clock = Clock()
    admission = controller(clock)
    admission.admit(request("a", 100, 100))
    cpu_like_steps(admission)
    steps(admission, (0.0901, 1, 1))
    idle_replica_s = admission.finish_estimate(request("c", 100, 10)).alone_s
    at_report = admission.finish_estimate(request("c", 100, 10))
    assert at_report.schedule.in_progress_s == pytest.approx(0.0901)
    clock.advance(0.06)
    mid_step = admission.finish_estimate(request("c", 100, 10))
    assert mid_step.schedule.in_progress_s == pytest.approx(0.0301)
    assert mid_step.total_s == pytest.approx(at_report.total_s - 0.06)
    assert "30 ms left of the step in progress" in mid_step.describe()
    clock.advance(1)
    assert admission.finish_estimate(request("c", 100, 10)).schedule.in_progress_s == 0
    assert admission.finish_estimate(request("c", 100, 10)).alone_s == idle_replica_s  # never on an idle one


def _deadline_refused(admission, clock, deadline_s: float) -> DeadlineExceeded:
    with pytest.raises(DeadlineExceeded) as refused:
        admission.admit(request("c", 100, 10, deadline_ns=clock.now_ns + round(deadline_s * S)))
    return refused.value


def test_a_deadline_refusal_carries_its_estimate_and_a_hint_only_when_a_retry_fits():
    clock = Clock()
    admission = controller(clock)
    cpu_like_steps(admission)
    admission.admit(request("a", 100, 100))
    admission.admit(request("b", 2900))
    refused = _deadline_refused(admission, clock, 1.5)
    # 3100 prompt tokens in a full step of 2048 tokens (314.8 ms) and one of the 1055 left
    # (215.8 ms), then 9 decode steps of the batch of 3 (110.3 ms): 1.5233 s against the 1.35 s
    # of the 1.5 s left that a deadline's slack leaves
    reason, _, fields = refused.error_info
    assert reason == DEADLINE_ESTIMATE_REASON
    assert fields["estimated_ms"] == "1523" and fields["time_left_ms"] == "1500" and fields["batch"] == "3"
    assert fields["full_step_ms"] == "315" and fields["last_full_step_ms"] == "216" and fields["decode_step_ms"] == "110"
    # A retry keeps the deadline: waiting h drains the work ahead by h but the promise by 0.9 h,
    # so the 173 ms excess needs h >= 1.73 s, and the work ahead lasts only 0.612 s (1.5233 s
    # less the 0.911 s of its own prefill and decode alone, 100.1 + 9 x 90.1 ms): no wait fits
    assert refused.retry_after_ms is None
    # 50 ms short instead: a retry fits from h = 0.5 s on (the work ahead lasts 0.612 s)
    estimate = admission.finish_estimate(request("c", 100, 10))
    refused = _deadline_refused(admission, clock, (estimate.total_s - 0.05) / (1 - DEADLINE_SLACK))
    assert abs(refused.retry_after_ms - 500) <= 1
    # 0.5 s left: not even an idle replica finishes in time: no hint
    assert _deadline_refused(admission, clock, 0.5).retry_after_ms is None


def test_a_full_queue_refuses_by_deadline_what_the_queue_ahead_already_rules_out():
    """A queue budget's hint (come back when the queue has turned over) is for a request that
    could still meet its deadline; one that could not is told DEADLINE_EXCEEDED instead, since
    a retry would come back with less time and be refused again."""
    clock = Clock()
    admission = controller(clock, max_waiting_requests=2)
    cpu_like_steps(admission)
    admission.admit(request("a", 100, 100))
    admission.admit(request("b", 2900))
    with pytest.raises(ResourceExhausted):  # 10 s leaves room: the queue budget refuses it
        admission.admit(request("c", 100, 10, deadline_ns=clock.now_ns + 10 * S))
    with pytest.raises(DeadlineExceeded) as refused:  # 1.5 s does not (1.52 s estimated)
        admission.admit(request("c", 100, 10, deadline_ns=clock.now_ns + 3 * S // 2))
    assert refused.value.retry_after_ms is None


def test_deadline_hints_are_spread_above_the_earliest_retry_that_fits():
    clock = Clock()
    admission = controller(clock, spread=jittered(random.Random(7)))
    cpu_like_steps(admission)
    admission.admit(request("a", 100, 100))
    admission.admit(request("b", 2900))
    estimate = admission.finish_estimate(request("c", 100, 10))
    deadline_s = (estimate.total_s - 0.05) / (1 - DEADLINE_SLACK)
    # A retry fits from 0.5 s on, and until its own work alone stops fitting what is left: ~0.625 s
    latest_ms = 1000 * (deadline_s - estimate.alone_s / (1 - DEADLINE_SLACK))
    hints = [_deadline_refused(admission, clock, deadline_s).retry_after_ms for _ in range(40)]
    assert all(500 - 1 <= hint <= latest_ms for hint in hints)  # never sooner than a retry fits
    assert len(set(hints)) > 15


def test_retry_hints_are_spread_so_refused_clients_do_not_return_together():
    clock = Clock()
    admission = controller(clock, max_waiting_requests=1, spread=jittered(random.Random(7)))
    admission.admit(request("a", 60))
    clock.advance(0.5)
    admission.observe([token("a")])  # 120 prompt tokens/s
    admission.admit(request("b", 120))  # the queue turns over in 1 s
    hints = []
    for attempt in range(50):
        with pytest.raises(ResourceExhausted) as refused:
            admission.admit(request(f"c{attempt}", 10))
        hints.append(refused.value.retry_after_ms)
    assert all(SPREAD_LOW * 1000 <= hint <= SPREAD_HIGH * 1000 for hint in hints)
    assert len(set(hints)) > 40  # not one instant for all


@pytest.mark.parametrize(("step_s", "expected_ms"), [(0.001, MIN_RETRY_AFTER_MS), (100.0, MAX_RETRY_AFTER_MS)])
def test_retry_hints_are_clamped(step_s, expected_ms):
    clock = Clock()
    admission = controller(clock, max_waiting_requests=1)
    admission.admit(request("a", 1))
    clock.advance(step_s)
    admission.observe([token("a")])
    admission.admit(request("b", 1))
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("c", 1))
    assert refused.value.retry_after_ms == expected_ms


# --- shared prefixes (prefix_charge.PrefixCharge) ----------------------------------------------

# 520 prompt tokens: the 32 blocks of SYSTEM_PROMPT[:512], then 8 tokens of its own; 24 more
# tokens make 544 = 34 blocks at full length, so each holds 2 blocks of its own.
SHARED_TOKENS, PROMPT_TOKENS, MAX_TOKENS = 32 * BLOCK, 32 * BLOCK + 8, 24
NUM_SHARERS = 8
PREFIX_ONCE_AND_TAILS = 32 + NUM_SHARERS * 2


def sharer(request_id: str, **options) -> EngineRequest:
    return request(request_id, PROMPT_TOKENS, MAX_TOKENS, num_shared_tokens=SHARED_TOKENS, **options)


def test_requests_sharing_a_prefix_are_charged_its_blocks_once():
    admission = controller(Clock(), kv_blocks_total=PREFIX_ONCE_AND_TAILS)
    admission.admit(sharer("s0"))
    admission.observe([token("s0")])  # its prompt's blocks are computed: the others find them cached
    for index in range(1, NUM_SHARERS):
        admission.admit(sharer(f"s{index}"))
    assert admission.num_kv_blocks_demanded == PREFIX_ONCE_AND_TAILS
    assert admission.num_waiting_prompt_tokens == (NUM_SHARERS - 1) * 8  # their own tokens only
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(sharer("one-too-many"))
    assert "need 48 KV blocks and this one 2, over the 48" in refused.value.message


def test_while_no_holder_has_started_a_chunk_of_blocks_is_kept_free_for_twins():
    clock = Clock()
    admission = controller(clock, kv_blocks_total=PREFIX_ONCE_AND_TAILS)
    admission.admit(sharer("s0"))
    with pytest.raises(ResourceExhausted) as refused:  # 2048 tokens per step: 128 blocks, at most its 32
        admission.admit(sharer("s1"))
    assert "need 34 KV blocks and this one 2 and 32 kept free for twins, over the 48" in refused.value.message
    admission.observe([token("s0")])
    admission.admit(sharer("s1"))
    # a step of 2 blocks' tokens computes at most 2 blocks twice at once, however many wait
    admission = controller(clock, kv_blocks_total=PREFIX_ONCE_AND_TAILS + 2, max_batched_tokens=2 * BLOCK)
    for index in range(NUM_SHARERS):
        admission.admit(sharer(f"s{index}"))
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(sharer("one-too-many"))
    assert "this one 2 and 2 kept free for twins, over the 50" in refused.value.message
    # once they have all started, none can be computing the prefix again
    admission.observe([token(f"s{index}") for index in range(NUM_SHARERS)])
    admission.admit(sharer("one-more"))


def test_distinct_prompts_of_the_same_length_are_charged_in_full():
    admission = controller(Clock(), kv_blocks_total=PREFIX_ONCE_AND_TAILS)
    admission.admit(request("a", PROMPT_TOKENS, MAX_TOKENS))
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(request("b", PROMPT_TOKENS, MAX_TOKENS))
    assert "need 34 KV blocks and this one 34, over the 48" in refused.value.message


def test_different_cache_salts_share_no_charge():
    admission = controller(Clock(), kv_blocks_total=PREFIX_ONCE_AND_TAILS)
    admission.admit(sharer("a", cache_salt="tenant-1"))
    admission.observe([token("a")])
    with pytest.raises(ResourceExhausted):
        admission.admit(sharer("b", cache_salt="tenant-2"))
    admission.admit(sharer("c", cache_salt="tenant-1"))


def test_without_a_prefix_cache_every_prompt_is_charged_in_full():
    admission = controller(Clock(), kv_blocks_total=PREFIX_ONCE_AND_TAILS, shares_prefix_blocks=False)
    admission.admit(sharer("a"))
    assert admission.num_waiting_prompt_tokens == PROMPT_TOKENS
    with pytest.raises(ResourceExhausted):
        admission.admit(sharer("b"))


def test_a_shared_prefix_stays_charged_until_its_last_holder_ends():
    clock = Clock()
    admission = controller(clock, kv_blocks_total=PREFIX_ONCE_AND_TAILS)
    admission.admit(sharer("first"))
    admission.observe([token("first")])
    admission.admit(sharer("second"))
    admission.admit(sharer("third"))
    assert admission.num_kv_blocks_demanded == 32 + 3 * 2
    clock.advance(1.0)
    admission.observe([finished("first")])  # the prefix was charged to it: the others hold it now
    assert admission.num_kv_blocks_demanded == 32 + 2 * 2
    clock.advance(1.0)
    admission.observe([finished("third")])
    assert admission.num_kv_blocks_demanded == 32 + 2
    admission.observe([finished("second")])
    assert admission.num_kv_blocks_demanded == 0
    # the drain measured what the demand lost: 4 blocks in the first 2 s in flight, not 68
    assert admission.kv_drain.per_s == pytest.approx(2.0)
    # nothing leaked: a request as large as the whole budget fits again
    admission.admit(request("whole", PREFIX_ONCE_AND_TAILS * BLOCK - MAX_TOKENS, MAX_TOKENS))


def test_refusals_and_aborts_leave_no_charge_behind():
    clock = Clock()
    admission = controller(clock, kv_blocks_total=PREFIX_ONCE_AND_TAILS)
    admission.admit(sharer("a"))
    with pytest.raises(ResourceExhausted, match="kept free for twins"):
        admission.admit(sharer("early"))
    admission.observe([token("a")])
    with pytest.raises(DeadlineExceeded):
        admission.admit(sharer("late", deadline_ns=clock.now_ns))
    with pytest.raises(ResourceExhausted):
        admission.admit(request("distinct", PROMPT_TOKENS, MAX_TOKENS))
    admission.admit(sharer("b"))
    cancelled = EngineOutput("b", 0, [], finish_reason=FinishReason.CANCELLED)
    admission.observe([cancelled, finished("a")])
    assert admission.num_kv_blocks_demanded == 0 and admission.num_waiting_prompt_tokens == 0
    admission.admit(request("whole", PREFIX_ONCE_AND_TAILS * BLOCK - MAX_TOKENS, MAX_TOKENS))


def test_the_deadline_estimate_waits_only_for_prompt_tokens_not_held_by_another():
    clock = Clock()
    admission = controller(clock, kv_blocks_total=1000)
    admission.admit(request("a", 100, 100))
    clock.advance(0.1)
    admission.observe([token("a")])
    admission.admit(sharer("b"))
    # 520 tokens of b waiting; c's 512 shared ones are b's: 528 tokens ahead
    assert admission.finish_estimate(sharer("c")).prompt_tokens_ahead == 528


def test_the_hashes_are_the_engines_own():
    tokens = SYSTEM_PROMPT[: 3 * BLOCK + 5]
    expected = NAMESPACE.block_hashes(tokens, "salt")

    def with_hashes(block_hashes, block_hash_version=HASH_VERSION):
        return EngineRequest(
            "r", tokens, SamplingParams(max_tokens=1), arrival_ns=0, block_hashes=block_hashes, block_size_tokens=BLOCK,
            block_hash_version=block_hash_version, cache_salt="salt",
        )  # fmt: skip

    assert prompt_block_hashes(with_hashes([]), NAMESPACE) == expected
    assert prompt_block_hashes(with_hashes(expected[:1]), NAMESPACE) == expected  # the rest chained on
    assert prompt_block_hashes(with_hashes([7, 8, 9]), NAMESPACE) == [7, 8, 9]  # preprocess's, trusted
    assert prompt_block_hashes(with_hashes([7, 8, 9], HASH_VERSION + 1), NAMESPACE) == expected


def test_random_traffic_keeps_the_charge_exact_and_leaves_none():
    rng = random.Random(10)
    clock = Clock()
    pool = 200
    admission = controller(clock, kv_blocks_total=pool, max_batched_tokens=4 * BLOCK)
    in_flight: dict[str, tuple[list[int], int, int]] = {}  # id -> (hashes, own blocks, unfinished sequences)
    num_refused, num_admitted = 0, 0
    for step in range(1000):
        clock.advance(0.01)
        if rng.random() < 0.5:
            num_shared = rng.choice([0, BLOCK, 5 * BLOCK, 20 * BLOCK, 40 * BLOCK])
            new = request(
                f"r{step}", num_shared + rng.randrange(0, 3 * BLOCK), rng.randrange(1, 40), n=rng.choice([1, 2]),
                num_shared_tokens=num_shared, cache_salt=rng.choice(["", "", "t"]),
            )  # fmt: skip
            try:
                admission.admit(new)
            except ResourceExhausted:
                num_refused += 1
            else:
                num_admitted += 1
                hashes = NAMESPACE.block_hashes(new.prompt_token_ids, new.cache_salt)
                own = kv_blocks_needed(new, BLOCK) - len(hashes)
                in_flight[new.request_id] = (hashes, own, new.sampling.n)
        elif in_flight:
            request_id = rng.choice(list(in_flight))
            hashes, own, num_unfinished = in_flight[request_id]
            ends = rng.random() < 0.4
            admission.observe([(finished if ends else token)(request_id, num_unfinished - 1)])
            if ends and num_unfinished == 1:
                del in_flight[request_id]
            elif ends:
                in_flight[request_id] = (hashes, own, num_unfinished - 1)
        distinct_hashes = {block_hash for hashes, _, _ in in_flight.values() for block_hash in hashes}
        expected = len(distinct_hashes) + sum(own for _, own, _ in in_flight.values())
        assert admission.num_kv_blocks_demanded == expected <= pool
    assert num_refused > 100 and num_admitted > 100  # the budget binds, and is freed again
    for request_id, (_, _, num_unfinished) in list(in_flight.items()):
        admission.observe([finished(request_id, index) for index in range(num_unfinished)])
    assert admission.num_kv_blocks_demanded == 0 and admission.num_waiting_prompt_tokens == 0
    assert admission.num_waiting_requests == 0 and admission.num_sequences_in_flight == 0


def test_skipping_far_deadlines_changes_no_admission():
    """The promise check's shortcut (`_cannot_harm_any`: no admitted deadline is near enough to
    be broken) gives the same answer as checking every admitted request, over random bursts
    mixing near, tight and far deadlines, long and short requests, and requests that end."""
    rng, seen = random.Random(5), collections.Counter()
    for scenario in range(40):
        clocks, owners = (Clock(), Clock()), []
        for clock in clocks:
            owners.append(controller(clock, max_waiting_requests=10_000))
            cpu_like_steps(owners[-1])
        shortcut = owners[0].admission._cannot_harm_any

        def counted(*args, shortcut=shortcut):
            skipped = shortcut(*args)
            seen["skipped" if skipped else "checked"] += 1
            return skipped

        owners[0].admission._cannot_harm_any = counted
        owners[1].admission._cannot_harm_any = lambda *args: False  # the full check, always
        for index in range(60):
            prompt, max_tokens = rng.choice((16, 100, 700, 2000)), rng.choice((1, 8, 64, 300))
            deadline_s = rng.choice((0.0, 0.5, 2.0, 6.0, 30.0, 600.0))
            outcomes = []
            for clock, owner in zip(clocks, owners):
                deadline_ns = clock.now_ns + int(deadline_s * S) if deadline_s else 0
                try:
                    owner.admit(request(f"s{scenario}-{index}", prompt, max_tokens, deadline_ns=deadline_ns))
                    outcomes.append("admitted")
                except (DeadlineExceeded, ResourceExhausted) as refused:
                    outcomes.append(type(refused).__name__)
            assert outcomes[0] == outcomes[1], (scenario, index, outcomes)
            seen[outcomes[0]] += 1
            if rng.random() < 0.3:  # time passes and the oldest request in flight ends
                for clock, owner in zip(clocks, owners):
                    clock.advance(0.3)
                    if owner._in_flight:
                        owner.observe([finished(next(iter(owner._in_flight)))])
    # both ways of the shortcut, and both kinds of refusal, were exercised
    assert seen["skipped"] and seen["checked"] and seen["ResourceExhausted"] and seen["DeadlineExceeded"], seen

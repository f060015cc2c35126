"""Scheduler: batch composition, chunking, priorities, preemption, rejection, abort, forks and
the update of a step's results.

Pure Python with block size 4, through the engine's own calls: `run_step` is one step of the
engine without async scheduling (schedule, record_launch of the launched batch, then
update_from_output with its sampled tokens).
"""

from __future__ import annotations

import functools
import random

import pytest

from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from llmserve.inference.engine.sequence import PLACEHOLDER_TOKEN, SequenceStatus
from llmserve.inference.engine.step_output import LaunchedBatch
from llmserve.inference.engine.stop import length_limit, reaches_length_limit
from llmserve.sampling import FinishReason, SamplingParams
from tests import engine_objects

BLOCK_SIZE = 4
SAMPLED_TOKEN = 7
EOS = 99_999


def make_scheduler(
    num_blocks: int = 16,
    max_num_seqs: int = 4,
    max_batched_tokens: int = 16,
    chunked: bool = True,
    max_seq_tokens: int | None = None,
    prefix_caching: bool = True,
) -> Scheduler:
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        max_seq_tokens=max_seq_tokens or num_blocks * BLOCK_SIZE,
        enable_chunked_prefill=chunked,
        eos_token_ids=frozenset({EOS}),
    )
    return Scheduler(config, manager)


make_seq = functools.partial(engine_objects.make_seq, max_tokens=64)


def run_step(scheduler: Scheduler, stopping=(), forks=()) -> ScheduledBatch:
    """Every sequence that samples gets SAMPLED_TOKEN, or EOS if in `stopping`; `forks`:
    (parent, child) pairs whose child samples from the parent's row, as the engine forks them."""
    batch = scheduler.schedule()
    seqs = batch.sampling_seqs() + [child for _, child in forks]
    launch = LaunchedBatch(batch, seqs, list(forks))
    scheduler.record_launch(launch)
    token_ids = [EOS if seq in stopping else SAMPLED_TOKEN for seq in seqs]
    scheduler.update_from_output(launch, token_ids)
    return batch


def plan(batch: ScheduledBatch) -> list[tuple[int, int]]:
    return [(seq.seq_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]


def assert_pool_full(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def finish_all(scheduler: Scheduler) -> None:
    for seq in list(scheduler.running) + list(scheduler.waiting):
        scheduler.abort(seq.request_id)


def test_decodes_go_first_and_a_long_prompt_is_chunked_around_them():
    scheduler = make_scheduler(max_batched_tokens=8)
    scheduler.add(make_seq(4, seq_id=1))
    assert plan(run_step(scheduler)) == [(1, 4)]
    scheduler.add(make_seq(20, seq_id=2))  # joins between steps
    assert plan(run_step(scheduler)) == [(1, 1), (2, 7)]
    assert plan(run_step(scheduler)) == [(1, 1), (2, 7)]
    batch = run_step(scheduler)
    assert plan(batch) == [(1, 1), (2, 6)]
    assert [batch.seqs[1].num_completion_tokens] == [1]  # the last chunk sampled a token
    assert plan(run_step(scheduler)) == [(1, 1), (2, 1)]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_max_num_seqs_holds_back_new_sequences():
    scheduler = make_scheduler(max_num_seqs=2)
    for seq_id in (1, 2, 3):
        scheduler.add(make_seq(3, seq_id=seq_id))
    first = scheduler.waiting.peek()
    assert plan(run_step(scheduler, stopping={first})) == [(1, 3), (2, 3)]
    assert [s.seq_id for s in scheduler.waiting] == [3] and first.finish_reason is FinishReason.STOP
    assert plan(run_step(scheduler)) == [(2, 1), (3, 3)]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_lower_priority_value_first_then_first_come_first_served():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_seq(2, seq_id=1, priority=5))
    scheduler.add(make_seq(2, seq_id=2, priority=0))
    scheduler.add(make_seq(2, seq_id=3, priority=0))
    scheduler.add(make_seq(2, seq_id=4, priority=-1))
    order = []
    while scheduler.waiting:
        batch = run_step(scheduler, stopping=set(scheduler.waiting))
        order.append(batch.seqs[0].seq_id)
    assert order == [4, 2, 3, 1]


def test_budget_smaller_than_the_decodes_defers_the_rest():
    scheduler = make_scheduler(max_batched_tokens=2)
    for seq_id in (1, 2, 3):
        scheduler.add(make_seq(1, seq_id=seq_id))
    assert plan(run_step(scheduler)) == [(1, 1), (2, 1)]
    assert plan(run_step(scheduler)) == [(1, 1), (2, 1)]  # decodes first; 3 still waits
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_preemption_frees_the_newest_and_it_resumes_from_the_cache():
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_seq(8, seq_id=1), make_seq(8, seq_id=2)
    scheduler.add(a)
    scheduler.add(b)
    assert plan(run_step(scheduler)) == [(1, 8), (2, 8)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    # Both need a third block for their 9th token; the pool is full: b (newest) is preempted.
    assert plan(run_step(scheduler)) == [(1, 1)]
    assert scheduler.num_preemptions_total == 1
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert a.block_ids == [0, 1, 3]  # b's tail block went first; its block 2 stays cached
    c = make_seq(2, seq_id=3)
    scheduler.add(c)  # newer arrival: queues behind the preempted b
    assert [s.seq_id for s in scheduler.waiting] == [2, 3]
    assert plan(run_step(scheduler, stopping={a})) == [(1, 1)]  # b needs 2 fresh blocks, 0 are free: waits
    batch = run_step(scheduler)
    assert plan(batch) == [(2, 5), (3, 2)]  # b: 4 of its 9 tokens from the cache, 5 recomputed
    assert b.block_ids[0] == 2 and b.num_cached_tokens == 0  # cached tokens count first admission only
    assert b.token_ids[-2:] == [SAMPLED_TOKEN, SAMPLED_TOKEN]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    scheduler = make_scheduler(num_blocks=3, max_batched_tokens=4)
    a, b = make_seq(4, seq_id=1), make_seq(8, seq_id=2)
    scheduler.add(a)
    scheduler.add(b)
    assert plan(run_step(scheduler)) == [(1, 4)]  # budget 4: b waits
    assert plan(run_step(scheduler)) == [(1, 1), (2, 3)]
    # a's decode fits in block 1; b's next chunk needs a 4th block: b preempts itself.
    assert plan(run_step(scheduler)) == [(1, 1)]
    assert scheduler.num_preemptions_total == 1 and b.status is SequenceStatus.WAITING
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_a_prompt_that_can_never_fit_is_rejected_with_numbers():
    scheduler = make_scheduler(num_blocks=8, max_seq_tokens=32)
    too_long = make_seq(33, seq_id=1)
    scheduler.add(too_long)
    assert not scheduler.waiting
    assert scheduler.take_rejected() == [too_long]
    assert too_long.finish_reason is FinishReason.ERROR
    assert "33 tokens" in too_long.error_message and "at most 32" in too_long.error_message
    assert "8 blocks x 4 tokens" in too_long.error_message
    assert scheduler.take_rejected() == []
    assert run_step(scheduler).is_empty


def test_abort_frees_running_and_waiting_blocks_at_once():
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq(9, seq_id=1), make_seq(3, seq_id=2)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler)
    assert scheduler.block_manager.num_used_blocks == 3
    assert scheduler.abort("r1") == [running]
    assert running.finish_reason is FinishReason.CANCELLED
    assert scheduler.abort("r2") == [waiting]
    assert scheduler.abort("r2") == []
    assert not scheduler.running and not scheduler.waiting
    assert_pool_full(scheduler)


def test_without_chunking_prompts_run_whole():
    scheduler = make_scheduler(max_batched_tokens=8, chunked=False)
    scheduler.add(make_seq(10, seq_id=1))
    assert plan(run_step(scheduler)) == [(1, 10)]  # over budget but alone: runs whole
    scheduler.add(make_seq(6, seq_id=2))
    scheduler.add(make_seq(6, seq_id=3))
    assert plan(run_step(scheduler)) == [(1, 1), (2, 6)]  # 3 does not fit the remaining 1
    assert plan(run_step(scheduler)) == [(1, 1), (2, 1), (3, 6)]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_prefix_hits_skip_cached_tokens_and_are_counted():
    scheduler = make_scheduler()
    scheduler.add(make_seq(range(9), seq_id=1))
    run_step(scheduler)
    shared = make_seq(range(10), seq_id=2)  # same first 9 tokens
    scheduler.add(shared)
    assert plan(run_step(scheduler)) == [(1, 1), (2, 2)]
    assert shared.num_cached_tokens == 8 and shared.block_ids[:2] == scheduler.running[0].block_ids[:2]
    stats = scheduler.block_manager.stats()
    assert (stats.prefix_queried_tokens_total, stats.prefix_hit_tokens_total) == (19, 8)
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_prefix_caching_off_computes_everything():
    scheduler = make_scheduler(prefix_caching=False)
    scheduler.add(make_seq(range(9), seq_id=1))
    run_step(scheduler)
    scheduler.add(make_seq(range(10), seq_id=2))
    assert plan(run_step(scheduler)) == [(1, 1), (2, 10)]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_fork_shares_the_prompt_and_copies_the_partial_block_next_step():
    scheduler = make_scheduler(max_num_seqs=2)
    parent = make_seq(6, seq_id=1)
    scheduler.add(parent)
    child, late = make_seq(range(1000, 1006), seq_id=2), make_seq(range(1000, 1006), seq_id=3)
    run_step(scheduler, forks=[(parent, child), (parent, late)])  # the step that computes the prompt
    assert child.status is SequenceStatus.RUNNING and child.token_ids[-1] == SAMPLED_TOKEN
    assert child.block_ids == [parent.block_ids[0], 2]
    assert late.status is SequenceStatus.WAITING and late.block_ids == []  # running set full: recomputes later
    batch = run_step(scheduler)
    assert batch.block_copies == [(1, 2)]
    assert plan(batch) == [(1, 1), (2, 1)]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_async_steps_discard_the_token_launched_after_a_stop():
    """With async scheduling step N is launched before step N-1's tokens are known: a sequence
    that stops on one of them is not advanced and gets no placeholder when step N is recorded,
    and step N's token for it is dropped."""
    scheduler = make_scheduler()
    seq = make_seq(4, seq_id=1)
    scheduler.add(seq)
    first = scheduler.schedule()
    first_launch = LaunchedBatch(first, first.sampling_seqs())
    scheduler.record_launch(first_launch)
    assert seq.token_ids[-1] == PLACEHOLDER_TOKEN and seq.placeholder_row == 0
    second = scheduler.schedule()
    assert plan(second) == [(1, 1)]  # the placeholder, read on the device
    new_tokens = scheduler.update_from_output(first_launch, [EOS])
    assert new_tokens.token_ids == [EOS] and new_tokens.finishes == [(0, FinishReason.STOP, EOS)]
    second_launch = LaunchedBatch(second, second.sampling_seqs())
    scheduler.record_launch(second_launch)
    assert seq.token_ids == [1000, 1001, 1002, 1003, EOS] and seq.is_finished and not seq.has_placeholder
    assert len(scheduler.update_from_output(second_launch, [SAMPLED_TOKEN])) == 0
    assert_pool_full(scheduler)


def test_launches_and_their_tokens_are_recorded_in_order():
    """One launch in flight at a time: recording the next before the tokens of the one before,
    or tokens for a launch other than the one in flight, is a bug the scheduler refuses."""
    scheduler = make_scheduler()
    scheduler.add(make_seq(4))
    first = scheduler.schedule()
    first_launch = LaunchedBatch(first, first.sampling_seqs())
    scheduler.record_launch(first_launch)
    second = scheduler.schedule()
    second_launch = LaunchedBatch(second, second.sampling_seqs())
    with pytest.raises(AssertionError, match="the launch before"):
        scheduler.record_launch(second_launch)
    with pytest.raises(AssertionError, match="the launch recorded last"):
        scheduler.update_from_output(second_launch, [SAMPLED_TOKEN])
    assert scheduler.update_from_output(first_launch, [SAMPLED_TOKEN]).token_ids == [SAMPLED_TOKEN]
    scheduler.record_launch(second_launch)
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_a_sequence_whose_placeholder_is_its_last_token_is_not_scheduled_again():
    scheduler = make_scheduler()
    seq = make_seq(4, seq_id=1, max_tokens=1)
    scheduler.add(seq)
    batch = scheduler.schedule()
    launch = LaunchedBatch(batch, batch.sampling_seqs())
    scheduler.record_launch(launch)
    assert seq.is_finishing and scheduler.schedule().is_empty
    new_tokens = scheduler.update_from_output(launch, [SAMPLED_TOKEN])
    assert new_tokens.finishes == [(0, FinishReason.LENGTH, None)]
    assert_pool_full(scheduler)


def test_the_batch_knows_its_decodes_through_preemptions_chunks_and_arrivals():
    """ScheduledBatch.num_decodes (its leading decodes, which all sample) keeps
    sampling_indexes and one_token_indexes equal to their per-entry definitions in every step
    of a crowded run: short pools that preempt decodes while prefills are scheduled, one-token
    chunks at the end of the budget, arrivals and finishes."""
    rand = random.Random(11)
    scheduler = make_scheduler(num_blocks=14, max_num_seqs=6, max_batched_tokens=9)
    seen_preemption = seen_decodes = seen_one_token_chunk = False
    for step in range(400):
        if rand.random() < 0.3:
            scheduler.add(make_seq(rand.randrange(3, 18), seq_id=step + 1, max_tokens=rand.randrange(2, 12)))
        preempted_before = scheduler.num_preemptions_total
        batch = scheduler.schedule()
        seqs = batch.seqs
        assert batch.sampling_indexes() == [i for i in range(len(seqs)) if batch.samples(i)]
        assert batch.one_token_indexes() == [i for i, n in enumerate(batch.num_new_tokens) if n == 1]
        assert all(batch.samples(i) and batch.num_new_tokens[i] == 1 for i in range(batch.num_decodes))
        seen_decodes |= batch.num_decodes > 0
        seen_one_token_chunk |= any(n == 1 and not batch.samples(i) for i, n in enumerate(batch.num_new_tokens))
        seen_preemption |= scheduler.num_preemptions_total > preempted_before and batch.num_decodes > 0
        launch = LaunchedBatch(batch, batch.sampling_seqs())
        scheduler.record_launch(launch)
        scheduler.update_from_output(launch, [SAMPLED_TOKEN] * len(launch.sampling_seqs))
    assert seen_decodes and seen_one_token_chunk and seen_preemption


def test_a_decode_preempted_for_a_prefill_chunk_leaves_the_batchs_decodes():
    """A low-priority decode scheduled first, then preempted for a high-priority prompt's next
    chunk: the batch's decodes no longer count it, and the chunk, which does not end its
    prompt, does not sample."""
    scheduler = make_scheduler(num_blocks=5, max_num_seqs=4, max_batched_tokens=8)
    low = make_seq(3, seq_id=1, priority=1)
    scheduler.add(low)
    run_step(scheduler)  # low's prompt: it decodes from now on
    high = make_seq(16, seq_id=2, priority=0)
    scheduler.add(high)
    run_step(scheduler)  # low's decode, and high's first chunk of 7
    batch = scheduler.schedule()  # low needs a block for its next token; high's chunk preempts it
    assert low.status is SequenceStatus.WAITING and batch.seqs == [high] and batch.num_new_tokens == [7]
    assert batch.num_decodes == 0 and batch.sampling_indexes() == [] and batch.one_token_indexes() == []


@pytest.mark.parametrize("max_tokens", [1, 5, 30])
@pytest.mark.parametrize("max_seq_tokens", [12, 40])
def test_the_length_limit_as_a_count_is_the_length_rule(max_tokens, max_seq_tokens):
    """stop.length_limit, which record_launch compares each sequence's tokens with, says what
    stop.reaches_length_limit says at every length."""
    sampling = SamplingParams(max_tokens=max_tokens)
    num_prompt_tokens = 7
    limit = length_limit(num_prompt_tokens, sampling, max_seq_tokens)
    for num_tokens in range(num_prompt_tokens, 60):
        expected = reaches_length_limit(num_tokens - num_prompt_tokens, num_tokens, sampling, max_seq_tokens)
        assert (num_tokens >= limit) == expected, num_tokens

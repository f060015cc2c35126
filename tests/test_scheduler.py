"""Scheduler: batch composition, chunking, priorities, preemption, rejection and abort.

Pure Python with block size 4: `run_step` plays the engine (schedule, mark computed, append a
token to every sequence that samples).
"""

from __future__ import annotations

from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from llmserve.inference.engine.sequence import Sequence, SequenceStatus
from llmserve.sampling import FinishReason, SamplingParams

BLOCK_SIZE = 4
SAMPLED_TOKEN = 7


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
    )
    return Scheduler(config, manager)


def make_seq(seq_id: int, num_tokens: int, priority: int = 0, first_token: int | None = None) -> Sequence:
    start = seq_id * 1000 if first_token is None else first_token
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        sequence_index=0,
        token_ids=list(range(start, start + num_tokens)),
        num_prompt_tokens=num_tokens,
        sampling=SamplingParams(max_tokens=64),
        priority=priority,
    )


def run_step(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule()
    sampling = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
    scheduler.advance(batch)  # what the engine does once the batch is launched ...
    scheduler.register_computed_blocks(batch)  # ... and once its tokens are known
    for seq in sampling:
        seq.token_ids.append(SAMPLED_TOKEN)
    return batch


def plan(batch: ScheduledBatch) -> list[tuple[int, int]]:
    return [(seq.seq_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]


def assert_pool_full(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def finish_all(scheduler: Scheduler) -> None:
    for seq in list(scheduler.running) + list(scheduler.waiting):
        scheduler.finish(seq, FinishReason.LENGTH)


def test_decodes_go_first_and_a_long_prompt_is_chunked_around_them():
    scheduler = make_scheduler(max_batched_tokens=8)
    scheduler.add(make_seq(1, 4))
    assert plan(run_step(scheduler)) == [(1, 4)]
    scheduler.add(make_seq(2, 20))  # joins between steps
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
        scheduler.add(make_seq(seq_id, 3))
    assert plan(run_step(scheduler)) == [(1, 3), (2, 3)]
    assert [s.seq_id for s in scheduler.waiting] == [3]
    scheduler.finish(scheduler.running[0], FinishReason.STOP)
    assert plan(run_step(scheduler)) == [(2, 1), (3, 3)]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_lower_priority_value_first_then_first_come_first_served():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_seq(1, 2, priority=5))
    scheduler.add(make_seq(2, 2, priority=0))
    scheduler.add(make_seq(3, 2, priority=0))
    scheduler.add(make_seq(4, 2, priority=-1))
    order = []
    while scheduler.waiting:
        batch = run_step(scheduler)
        order.append(batch.seqs[0].seq_id)
        scheduler.finish(batch.seqs[0], FinishReason.STOP)
    assert order == [4, 2, 3, 1]


def test_budget_smaller_than_the_decodes_defers_the_rest():
    scheduler = make_scheduler(max_batched_tokens=2)
    for seq_id in (1, 2, 3):
        scheduler.add(make_seq(seq_id, 1))
    assert plan(run_step(scheduler)) == [(1, 1), (2, 1)]
    assert plan(run_step(scheduler)) == [(1, 1), (2, 1)]  # decodes first; 3 still waits
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_preemption_frees_the_newest_and_it_resumes_from_the_cache():
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_seq(1, 8), make_seq(2, 8)
    scheduler.add(a)
    scheduler.add(b)
    assert plan(run_step(scheduler)) == [(1, 8), (2, 8)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    # Both need a third block for their 9th token; the pool is full: b (newest) is preempted.
    assert plan(run_step(scheduler)) == [(1, 1)]
    assert scheduler.num_preemptions_total == 1
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert a.block_ids == [0, 1, 3]  # b's tail block went first; its block 2 stays cached
    c = make_seq(3, 2)
    scheduler.add(c)  # newer arrival: queues behind the preempted b
    assert [s.seq_id for s in scheduler.waiting] == [2, 3]
    assert plan(run_step(scheduler)) == [(1, 1)]  # b needs 2 fresh blocks, 0 are free: waits
    scheduler.finish(a, FinishReason.STOP)
    batch = run_step(scheduler)
    assert plan(batch) == [(2, 5), (3, 2)]  # b: 4 of its 9 tokens from the cache, 5 recomputed
    assert b.block_ids[0] == 2 and b.num_cached_tokens == 0  # cached tokens count first admission only
    assert b.token_ids[-2:] == [SAMPLED_TOKEN, SAMPLED_TOKEN]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    scheduler = make_scheduler(num_blocks=3, max_batched_tokens=4)
    a, b = make_seq(1, 4), make_seq(2, 8)
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
    too_long = make_seq(1, 33)
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
    running, waiting = make_seq(1, 9), make_seq(2, 3)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler)
    assert scheduler.block_manager.num_used_blocks == 3
    assert scheduler.abort("r1") == [running]
    assert running.finish_reason is FinishReason.CANCELLED
    assert scheduler.abort("r2") == [waiting]
    assert scheduler.abort("r2") == []
    assert not scheduler.has_unfinished()
    assert_pool_full(scheduler)


def test_without_chunking_prompts_run_whole():
    scheduler = make_scheduler(max_batched_tokens=8, chunked=False)
    scheduler.add(make_seq(1, 10))
    assert plan(run_step(scheduler)) == [(1, 10)]  # over budget but alone: runs whole
    scheduler.add(make_seq(2, 6))
    scheduler.add(make_seq(3, 6))
    assert plan(run_step(scheduler)) == [(1, 1), (2, 6)]  # 3 does not fit the remaining 1
    assert plan(run_step(scheduler)) == [(1, 1), (2, 1), (3, 6)]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_prefix_hits_skip_cached_tokens_and_are_counted():
    scheduler = make_scheduler()
    scheduler.add(make_seq(1, 9, first_token=0))
    run_step(scheduler)
    shared = make_seq(2, 10, first_token=0)  # same first 9 tokens
    scheduler.add(shared)
    assert plan(run_step(scheduler)) == [(1, 1), (2, 2)]
    assert shared.num_cached_tokens == 8 and shared.block_ids[:2] == scheduler.running[0].block_ids[:2]
    stats = scheduler.block_manager.stats()
    assert (stats.prefix_queried_tokens_total, stats.prefix_hit_tokens_total) == (19, 8)
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_prefix_caching_off_computes_everything():
    scheduler = make_scheduler(prefix_caching=False)
    scheduler.add(make_seq(1, 9, first_token=0))
    run_step(scheduler)
    scheduler.add(make_seq(2, 10, first_token=0))
    assert plan(run_step(scheduler)) == [(1, 1), (2, 10)]
    finish_all(scheduler)
    assert_pool_full(scheduler)


def test_fork_shares_the_prompt_and_copies_the_partial_block_next_step():
    scheduler = make_scheduler(max_num_seqs=2)
    parent = make_seq(1, 6)
    scheduler.add(parent)
    run_step(scheduler)
    child = make_seq(2, 6, first_token=1000)
    scheduler.add_fork(parent, child)
    assert child.status is SequenceStatus.RUNNING
    assert child.block_ids == [parent.block_ids[0], 2]
    child.token_ids.append(SAMPLED_TOKEN)
    batch = run_step(scheduler)
    assert batch.block_copies == [(1, 2)]
    assert plan(batch) == [(1, 1), (2, 1)]
    late = make_seq(3, 6, first_token=1000)
    scheduler.add_fork(parent, late)  # no sequence slot left: it waits and recomputes
    assert late.status is SequenceStatus.WAITING and late.block_ids == []
    finish_all(scheduler)
    assert_pool_full(scheduler)

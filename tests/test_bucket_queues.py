"""Per-bucket waiting queues in the Scheduler: short prompts start ahead of queued long ones,
long ones still get in, priority comes first, and nothing overtakes within a bucket."""

from __future__ import annotations

from llmserve.buckets import BucketConfig
from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import BLOCK_SIZE, EOS, assert_pool_full, make_seq, run_step

SHORT, LONG = 4, 20  # prompt tokens: bucket 0 (<= 8) and bucket 1 (<= 64)


def make_scheduler(max_num_seqs: int = 1) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_batched_tokens=64,
        max_seq_tokens=64,
        eos_token_ids=frozenset({EOS}),
        length_buckets=BucketConfig((8, 64)),
    )
    return Scheduler(config, BlockManager(32, BLOCK_SIZE))


def start_order(scheduler: Scheduler, arrivals_per_step: dict[int, list] | None = None) -> list[int]:
    """Run one sequence at a time to its first token (each stops there) until none waits; the
    seq_ids in the order they started. `arrivals_per_step[i]` are added before step i."""
    order, step = [], 0
    while scheduler.waiting or (arrivals_per_step or {}).get(step):
        for seq in (arrivals_per_step or {}).get(step, []):
            scheduler.add(seq)
        batch = run_step(scheduler, stopping=set(scheduler.waiting))
        order += [seq.seq_id for seq in batch.seqs]
        step += 1
    assert_pool_full(scheduler)
    return order


def test_a_short_prompt_starts_ahead_of_long_ones_queued_before_it():
    scheduler = make_scheduler()
    for seq_id in (1, 2, 3):
        scheduler.add(make_seq(LONG, seq_id=seq_id))
    scheduler.add(make_seq(SHORT, seq_id=4))
    scheduler.add(make_seq(SHORT, seq_id=5))
    # Turns between the buckets: FCFS within each, so the long ones keep their order.
    assert start_order(scheduler) == [4, 1, 5, 2, 3]


def test_a_long_prompt_gets_in_under_a_steady_stream_of_short_ones():
    scheduler = make_scheduler()
    scheduler.add(make_seq(LONG, seq_id=1))
    shorts = {step: [make_seq(SHORT, seq_id=10 + step)] for step in range(6)}
    order = start_order(scheduler, shorts)
    assert order[:3] == [10, 1, 11]  # one turn each
    assert sorted(order) == [1, *range(10, 16)]


def test_priority_comes_before_the_turns():
    scheduler = make_scheduler()
    scheduler.add(make_seq(SHORT, seq_id=1))
    scheduler.add(make_seq(LONG, seq_id=2, priority=-1))
    scheduler.add(make_seq(LONG, seq_id=3))
    scheduler.add(make_seq(SHORT, seq_id=4, priority=-1))
    assert start_order(scheduler) == [4, 2, 1, 3]


def test_the_waiting_queue_lists_every_sequence_by_priority_then_arrival():
    scheduler = make_scheduler()
    for seq_id, num_tokens, priority in ((1, LONG, 0), (2, SHORT, 0), (3, LONG, -1)):
        scheduler.add(make_seq(num_tokens, seq_id=seq_id, priority=priority))
    assert [seq.seq_id for seq in scheduler.waiting] == [3, 1, 2] and len(scheduler.waiting) == 3
    scheduler.abort("r1")
    assert [seq.seq_id for seq in scheduler.waiting] == [3, 2] and scheduler.waiting.peek().seq_id == 3

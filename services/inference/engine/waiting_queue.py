"""WaitingQueue: the sequences that wait to run, one queue per length bucket. Pure Python.

Each sequence waits in the bucket of its prompt length (llmserve/buckets.py; the engine's
--length-buckets, the same bounds preprocess reports), ordered by (priority, seq_id): first
come first served within a priority, and nothing overtakes within a bucket. A preempted
sequence or a sibling that could not start at once goes back to its bucket at its seq_id, so it
keeps its place.

Which bucket goes next:
  1. priority first: only buckets whose head has the lowest priority value take part;
  2. among those, the buckets take turns, one admitted sequence per turn (round robin by
     request), starting after the bucket that admitted last.
Why turns by request, not a deficit round robin by tokens: the queue only decides who *starts*
next; the scheduler's per-step token budget already meters the tokens (a long prompt is
chunked across steps). By request, a short prompt waits behind at most one long document per
other bucket instead of behind every document that came first, and a long document waits at
most one turn per other bucket, never "until the short ones stop coming", which a token deficit
would make it do for (its tokens / quantum) rounds under a steady stream of short requests.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator

from llmserve.buckets import BucketConfig
from llmserve.inference.engine.sequence import Sequence


def queue_key(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.seq_id)


class WaitingQueue:
    def __init__(self, buckets: BucketConfig):
        self._buckets = buckets
        self._queues: list[list[Sequence]] = [[] for _ in buckets.bounds]  # each sorted by queue_key
        self._next_turn = 0  # the bucket that has the next turn among equals
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, by (priority, seq_id) across the buckets."""
        return heapq.merge(*self._queues, key=queue_key)

    def add(self, seq: Sequence) -> None:
        bisect.insort(self._queue_of(seq), seq, key=queue_key)
        self._num_waiting += 1

    def remove(self, seq: Sequence) -> None:
        self._queue_of(seq).remove(seq)
        self._num_waiting -= 1

    def peek(self) -> Sequence | None:
        """The sequence to start next, or None when nothing waits."""
        index = self._next_bucket()
        return None if index is None else self._queues[index][0]

    def pop(self) -> Sequence:
        """Take the sequence peek() names; the turn passes to the following bucket."""
        index = self._next_bucket()
        assert index is not None, "pop from an empty WaitingQueue"
        self._next_turn = (index + 1) % len(self._queues)
        self._num_waiting -= 1
        return self._queues[index].pop(0)

    def _next_bucket(self) -> int | None:
        heads = [(queue[0].priority, i) for i, queue in enumerate(self._queues) if queue]
        if not heads:
            return None
        best_priority = min(priority for priority, _ in heads)
        num_buckets = len(self._queues)
        return min(
            (i for priority, i in heads if priority == best_priority),
            key=lambda i: (i - self._next_turn) % num_buckets,
        )

    def _queue_of(self, seq: Sequence) -> list[Sequence]:
        return self._queues[self._buckets.bucket_for(seq.num_prompt_tokens).index]

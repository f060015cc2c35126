"""KvEventCoalescer: a replica's prefix-cache changes reach the event log a batch at most every
interval, in order, and at once when a request ends."""

from __future__ import annotations

import asyncio
import logging

from llmserve.inference.kv_event_coalescer import KvEventCoalescer

INTERVAL_S = 0.5  # long beside the microseconds between two add() calls, on any loaded machine


def test_changes_within_the_interval_go_on_as_one_batch_in_order():
    async def main():
        batches = []
        coalescer = KvEventCoalescer(batches.append, INTERVAL_S)
        coalescer.add([1, 2])  # the first after a quiet time goes at once
        for event in (3, 4, 5):
            coalescer.add([event])
        assert batches == [[1, 2]]
        await asyncio.sleep(2 * INTERVAL_S)  # the timer hands on what waited
        assert batches == [[1, 2], [3, 4, 5]]
        await asyncio.sleep(2 * INTERVAL_S)
        assert batches == [[1, 2], [3, 4, 5]]  # nothing pending: no empty batch

    asyncio.run(main())


def test_a_final_output_flushes_what_is_pending_at_once():
    async def main():
        batches = []
        coalescer = KvEventCoalescer(batches.append, INTERVAL_S)
        coalescer.add([1])
        coalescer.add([2])
        coalescer.add([], flush_now=True)  # an update with a request's final output and no changes
        assert batches == [[1], [2]]
        await asyncio.sleep(2 * INTERVAL_S)
        assert batches == [[1], [2]]  # the timer had nothing left

    asyncio.run(main())


def test_a_failing_sink_is_logged_and_the_next_batch_still_goes(caplog):
    async def main():
        batches = []

        def sink(events):
            if events == [1]:
                raise RuntimeError("index broke")
            batches.append(events)

        coalescer = KvEventCoalescer(sink, INTERVAL_S)
        coalescer.add([1])
        coalescer.add([2], flush_now=True)
        assert batches == [[2]]

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert "the kv-event sink failed" in caplog.text

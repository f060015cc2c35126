"""KvEventCoalescer: a replica's prefix-cache changes reach the event log a batch at most every
interval, in order, and at once when a request ends (also through AsyncEngine, on the torch
engine)."""

from __future__ import annotations

import asyncio
import logging

from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.kv_event_coalescer import KvEventCoalescer
from tests.engine_objects import make_request

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


def test_a_requests_final_output_finds_every_block_it_filled_announced(tiny_model_dir):
    """AsyncEngine's wiring, on the torch engine: with an interval far longer than the request,
    the blocks a request fills after its first batch of changes wait in the coalescer, and its
    final output hands them on before it is delivered (a client's next turn finds them)."""
    def stored_blocks(batches: list) -> int:
        return sum(len(event[1]) for batch in batches for event in batch if isinstance(event, tuple))

    async def main():
        core = TorchEngineCore(EngineConfig(model_path=tiny_model_dir, model_name="tiny", num_kv_blocks=32,
                                            block_size_tokens=16))
        engine = AsyncEngine(EngineThread(core))
        await engine.start()
        batches = []
        engine.forward_kv_events(batches.append, interval_s=60.0)
        seen_at_final = asyncio.get_running_loop().create_future()
        seen_before_final = []

        def on_output(output, is_last):
            if is_last:
                seen_at_final.set_result(stored_blocks(batches))
            else:
                seen_before_final.append(stored_blocks(batches))

        # 40 prompt tokens (2 full blocks at the prefill) and 12 generated, of which the first
        # 11 are computed: the third block fills at token 48, mid-stream.
        engine.submit(make_request("r", range(3, 43), max_tokens=12, temperature=0.0, ignore_eos=True), on_output)
        assert await asyncio.wait_for(seen_at_final, 30) == 3
        assert seen_before_final and max(seen_before_final) == 2  # the third waited for the interval
        await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())

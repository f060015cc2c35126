"""Core calls answered mid-step (engine/mid_step_calls.py): a pin sent while the loop holds the
core is answered inside one of its steps' windows, never outside them, and is the pin the
between-steps path gives; a call that is not a mid-step call is refused at once.

The test's thread plays the engine loop's: it holds the core's lock except inside `step()`, so
a reply that arrives while it holds the lock could only have been made in a step's window."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from llmserve.inference.engine.engine_loop import CallCore
from llmserve.inference.engine.mid_step_calls import StepWindows, start_call_thread
from llmserve.tensor_transport import local_identity
from tests.test_torch_engine import greedy, make_engine, make_prompt, request, run
from tests.transport_peers import segments_of

CPU_IDENTITY = local_identity("cpu")
MAX_STEPS = 200


@pytest.fixture
def mid_step(tiny_model_dir):
    """(core with --kv-pull and its windows, the windows, the calls' write end, the replies' read end)."""
    core = make_engine(tiny_model_dir, kv_pull=True, async_scheduling=False)
    windows = StepWindows()
    windows.hold()
    core.open_windows(windows)
    call_reader, call_writer = multiprocessing.Pipe(duplex=False)
    reply_reader, reply_writer = multiprocessing.Pipe(duplex=False)
    thread = start_call_thread(call_reader, reply_writer, core, windows)
    yield core, windows, call_writer, reply_reader
    call_writer.close()  # the call thread ends at EOF
    with windows.open():
        thread.join(10)
    assert not thread.is_alive()
    core.close()
    assert segments_of([os.getpid()]) == []


def test_a_pin_sent_outside_a_step_is_answered_inside_one(mid_step):
    core, windows, calls, replies = mid_step
    cached = make_prompt(100, seed=1)
    run(core, [request("cached", cached, greedy(4))])
    core.add_request(request("busy", make_prompt(200, seed=2), greedy(40)))

    calls.send(CallCore(1, "kv_pin", (request("pull", cached, greedy(4)), 0, CPU_IDENTITY)))
    assert not replies.poll(0.3)  # the loop holds the core: no answer between steps
    num_steps = 0
    while not replies.poll() and num_steps < MAX_STEPS:
        core.step()  # its forward and its result wait are windows
        num_steps += 1
    assert replies.poll(), f"no answer in {num_steps} steps"
    reply, load = replies.recv()
    assert reply.call_id == 1 and reply.error is None, reply.error
    assert load.kv_blocks_used >= len(reply.result.block_ids)  # the pin's blocks count
    assert len(reply.result.block_ids) == (len(cached) - 1) // core.runner.block_size  # the whole cached prefix

    core.kv_release(list(reply.result.block_ids))
    while core.has_requests_in_flight():
        core.step()
    assert core.load().kv_blocks_used == 0


def test_a_call_that_must_wait_for_a_step_boundary_is_refused_in_the_next_window(mid_step):
    core, windows, calls, replies = mid_step
    calls.send(CallCore(7, "kv_release", ([1, 2],)))
    assert not replies.poll(0.3)  # the loop holds the core
    core.step()  # idle: no forward, no window
    with windows.open():  # as the loop's wait for commands opens one
        assert replies.poll(30)
    reply, _ = replies.recv()
    assert reply.call_id == 7 and isinstance(reply.error, NotImplementedError)
    assert "between steps" in str(reply.error)

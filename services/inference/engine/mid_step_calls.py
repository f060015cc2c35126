"""MidStepCalls: core calls answered while the engine loop is inside a step, not between two
(issue 22: the pin a puller asks a busy replica for).

A CallCore sent with the commands is applied between two steps (engine_loop.py). The replica a
router pulls from is the busy one, so a pin waited for the step in progress: up to a whole
step, a prefill chunk's seconds on a CPU. Here the engine-core process answers a call in
MID_STEP_CALLS on a thread of its own, reading a pipe of its own, as soon as the loop is in a
*window*: a stretch in which the loop thread touches none of the core's scheduling state.

The loop thread holds the core's lock except in its windows:
  - waiting for commands while no request is in flight (engine_process's command taker);
  - the model's forward: queuing it on a GPU, computing it on a CPU (TorchEngineCore._launch);
  - waiting for the step's sampled tokens (TorchEngineCore._process).
The call thread takes the lock for each call, so a call never overlaps the scheduler, the block
manager or the sampler's bookkeeping. What makes a pin safe in the forward's window: it holds
blocks the prefix cache has registered, and a block is registered after the launch that
computes it has queued its whole forward (Scheduler.record_launch runs after the runner), so
the pool's "written" event a pin records (KvPoolExport.mark_written) comes after every kernel
that writes a block it can return; a held block is never evicted or reused.

A core without windows (another backend) gets no call thread: the server sends its mid-step
calls with the commands (EngineProcess.call_core_mid_step), as before. So does an engine core
on a thread of the server process (EngineThread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from multiprocessing.connection import Connection

from llmserve.inference.engine.engine_loop import CallCore, CoreReply, answer_call

log = logging.getLogger(__name__)

# The calls a core answers mid-step: a pin only reads the prefix cache and takes references.
# An import (it allocates blocks and writes the pool) and a release stay between steps.
MID_STEP_CALLS = frozenset({"kv_pin"})


class StepWindows:
    """The core's lock: held by the loop thread outside its windows, taken by the call thread
    for each call. Made and taken (`hold`) on the loop thread before the loop starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def hold(self) -> None:
        self._lock.acquire()

    @contextlib.contextmanager
    def open(self):
        """A window: the loop thread lets calls run until the block ends."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    @contextlib.contextmanager
    def call(self):
        """The call thread: the core to itself for one call."""
        with self._lock:
            yield


def serve_mid_step_calls(calls: Connection, replies: Connection, core, windows: StepWindows) -> None:
    """The call thread's main: answer each CallCore from `calls` in a window, on `replies` as
    (CoreReply, the core's load after it), until the server process closes its end."""
    while True:
        try:
            command: CallCore = calls.recv()
        except (EOFError, OSError):
            return
        with windows.call():
            if command.method not in MID_STEP_CALLS:
                error = NotImplementedError(f"{command.method} is answered between steps, not mid-step")
                reply = CoreReply(command.call_id, error=error)
            else:
                reply = answer_call(core, command)
            load = core.load()  # a pin's blocks count as used; the loop reports loads only per iteration
        try:
            replies.send((reply, load))
        except (BrokenPipeError, OSError):
            return


def start_call_thread(calls: Connection, replies: Connection, core, windows: StepWindows) -> threading.Thread:
    thread = threading.Thread(
        target=serve_mid_step_calls, args=(calls, replies, core, windows), name="mid-step-calls", daemon=True
    )
    thread.start()
    return thread

"""EngineThread: an EngineLoop on a thread of the server process, fed by the event loop.

The core shares the process's GIL with gRPC serving (torch releases it inside its kernels):
the simplest way to run a core, and the one the `hf` backend and tests use. engine_process.py
runs the same loop in a process of its own.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from llmserve.inference.engine.engine_loop import CoreReply, CoreUpdate, Deliver, EngineCommand, EngineLoop, Stop
from llmserve.engine_output import StepOutputs
from llmserve.inference.engine.queued_client import QueuedCoreClient
from llmserve.inference.engine.types import CacheEvent, EngineCore, EngineLoad, StepReport

log = logging.getLogger(__name__)


class EngineThread(QueuedCoreClient):
    """add_request, abort_request, start and stop are called from the event loop; the core is
    only called from the thread."""

    def __init__(self, core: EngineCore):
        super().__init__(core.model_info, core.load())
        self._loop_body = EngineLoop(core)
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        """Start the thread; it hands every step's outputs, cache changes and StepReport to
        `deliver`, run on `loop`."""
        self._event_loop, self._deliver = loop, deliver
        self._thread = threading.Thread(
            target=self._loop_body.run, args=(self._take_commands, self._emit), name="engine", daemon=True
        )
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """Started and not yet stopped."""
        return self._thread is not None

    async def stop(self) -> None:
        """Cancel every request in flight, then end and join the thread (off the event loop,
        which must keep running to receive the CANCELLED outputs)."""
        self._commands.put(Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _take_commands(self, block: bool) -> list[EngineCommand]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _emit(
        self, outputs: StepOutputs, load: EngineLoad, kv_events: list[CacheEvent], step: StepReport | None,
        replies: list[CoreReply],
    ) -> bool:
        """On the thread: store the load, hand the rest to the event loop."""
        self._load_snapshot = load
        if not outputs and not kv_events and step is None and not replies:
            return True
        update = CoreUpdate(outputs.expanded(), kv_events, [step] if step else [], replies)
        try:
            self._event_loop.call_soon_threadsafe(self._deliver, update)
        except RuntimeError:  # the event loop is closed: nobody is left to read
            log.warning("event loop closed; engine thread exits")
            return False
        return True

"""QueuedCoreClient: what the two core clients that run an EngineLoop share, EngineThread (the
loop on a thread of the server process) and EngineProcess (in a process of its own).

Both take commands on the event loop without waiting: add_request and abort_request put them
on a queue that the engine thread drains (EngineProcess writes them into its pipe instead:
engine/command_pipe.py), and load() answers the latest snapshot the loop reported, never
asking the core.
"""

from __future__ import annotations

import asyncio
import queue

from llmserve.inference.engine.engine_loop import AbortRequest, AddRequest, CallCore, Deliver, EngineCommand
from llmserve.inference.engine.types import EngineLoad, EngineRequest, ModelInfo


class QueuedCoreClient:
    """The command queue and load snapshot of a core client; a subclass adds start, stop and
    is_running, and replaces `_load_snapshot` whenever the loop reports a load."""

    def __init__(self, model_info: ModelInfo, load: EngineLoad):
        self.model_info = model_info
        self._load_snapshot = load
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._event_loop: asyncio.AbstractEventLoop | None = None  # set by start
        self._deliver: Deliver | None = None  # set by start: called on _event_loop

    def add_request(self, request: EngineRequest) -> None:
        self._commands.put(AddRequest(request))

    def abort_request(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    def call_core(self, call: CallCore) -> None:
        self._commands.put(call)

    def load(self) -> EngineLoad:
        """The snapshot taken after the latest iteration that changed it."""
        return self._load_snapshot

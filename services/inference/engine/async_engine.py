"""AsyncEngine: the asyncio face of one EngineCore, which runs on an EngineThread.

    event loop (servicer)                               engine thread (engine_thread.py)
    generate() ──add_request──▶ command queue ──▶ core.add_request
    abort()    ──abort_request─▶              ──▶ core.abort_request (+ CANCELLED outputs)
                                                  core.step() → [EngineOutput]
    per-request asyncio.Queue ◀── call_soon_threadsafe(_deliver, outputs) ◀──┘

Generation never blocks the event loop: the core only runs on the engine thread (torch releases
the GIL inside its kernels). The thread sleeps on the command queue when the core is idle.

A request is *in flight* from generate() until its stream has received the final output of
each of its sequences, even when its consumer left early: its request id stays taken until the
core has let go of it, so a new request reusing the id never receives the old one's outputs.
The engine thread guarantees each sequence exactly one final output (see engine_thread.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from llmserve.errors import InvalidArgument, Unavailable
from llmserve.inference.admission import AdmissionConfig, AdmissionController
from llmserve.inference.engine.engine_thread import EngineThread
from llmserve.inference.engine.types import EngineCore, EngineLoad, EngineOutput, EngineRequest, ModelInfo

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    """The loop-side state of one in-flight request."""

    outputs: asyncio.Queue[EngineOutput]
    num_unfinished_sequences: int
    is_detached: bool = False  # the consumer left; outputs are counted, not queued
    is_aborting: bool = False


class AsyncEngine:
    """Owns an EngineCore and the EngineThread that drives it. Every public method runs on the
    event loop."""

    def __init__(self, core: EngineCore, admission: AdmissionConfig = AdmissionConfig()):
        self.model_info: ModelInfo = core.model_info
        self._engine_thread = EngineThread(core)
        self._admission = AdmissionController(
            admission,
            kv_blocks_total=self._engine_thread.load().kv_blocks_total,
            block_size_tokens=self.model_info.block_size_tokens,
            max_context_tokens=self.model_info.max_context_tokens,
        )
        self._streams: dict[str, _Stream] = {}  # request_id → stream, for each in-flight request
        self._is_accepting = False
        self._none_in_flight = asyncio.Event()
        self._none_in_flight.set()

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._engine_thread.start(asyncio.get_running_loop(), self._deliver)
        self._is_accepting = True

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Stop accepting (Unavailable), let in-flight requests finish for up to
        `drain_timeout_s`, abort the rest, then stop and join the engine thread."""
        self._is_accepting = False
        if not self._engine_thread.is_running:
            return
        if self._streams:
            try:
                await asyncio.wait_for(self._none_in_flight.wait(), timeout=drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("drain timeout (%.1fs): aborting %d requests", drain_timeout_s, len(self._streams))
                for request_id in list(self._streams):
                    self.abort(request_id)
        await asyncio.to_thread(self._engine_thread.stop)

    # --- requests ---------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs until every sequence has finished.

        Leaving early (break + aclose, cancellation, an exception in the consumer) aborts the
        request in the core, which frees its KV blocks. A request the replica cannot take now
        raises before anything is queued (see admission.py).
        """
        if not self._is_accepting:
            raise Unavailable("the inference engine is shutting down")
        if request.request_id in self._streams:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already in flight")
        self._admission.admit(request)
        stream = _Stream(outputs=asyncio.Queue(), num_unfinished_sequences=request.sampling.n)
        self._streams[request.request_id] = stream
        self._none_in_flight.clear()
        self._engine_thread.add_request(request)
        num_finished_sequences = 0
        try:
            while num_finished_sequences < request.sampling.n:
                output = await stream.outputs.get()
                num_finished_sequences += int(output.is_finished)
                yield output
        finally:
            if num_finished_sequences < request.sampling.n:
                stream.is_detached = True
                self.abort(request.request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request; True if it was in flight and not already being aborted. Idempotent.

        Its stream (if still read) ends with a CANCELLED output for each unfinished sequence.
        """
        stream = self._streams.get(request_id)
        if stream is None or stream.is_aborting:
            return False
        stream.is_aborting = True
        self._engine_thread.abort_request(request_id)
        return True

    def load(self) -> EngineLoad:
        """The engine thread's latest snapshot; no call into the core."""
        return self._engine_thread.load()

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        """Runs on the loop: route outputs to their streams; a request whose every sequence
        has its final output is no longer in flight."""
        self._admission.observe(outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                log.error("output for unknown request %r dropped", output.request_id)
                continue
            if not stream.is_detached:
                stream.outputs.put_nowait(output)
            if output.is_finished:
                stream.num_unfinished_sequences -= 1
                if stream.num_unfinished_sequences == 0:
                    del self._streams[output.request_id]
        if not self._streams:
            self._none_in_flight.set()

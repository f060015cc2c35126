"""AsyncEngine: runs one EngineCore on a dedicated engine thread, for an asyncio servicer.

    asyncio loop (servicer)                          engine thread
    generate() ──_AddRequest──▶ command queue ──▶ core.add_request
    abort()    ──_AbortRequest─▶              ──▶ core.abort_request (+ CANCELLED outputs)
                                                  core.step() → [EngineOutput]
    per-request asyncio.Queue ◀── call_soon_threadsafe(_deliver, outputs) ◀──┘

Generation never blocks the event loop: the core only runs on the engine thread (torch releases
the GIL inside its kernels). The thread sleeps on the command queue when the core is idle.

Invariant: every request handed to the core gets exactly one finished output per sequence —
from the core, from an abort (CANCELLED) or from a failure (ERROR). The engine thread tracks
the unfinished sequences to keep it; the loop side removes a request from the in-flight table
when its last finished output arrives, so a request id stays taken until the core has let go
of it (a new request reusing the id can never receive the old one's outputs).

A step that raises fails only the requests named by the exception's `request_ids` attribute
when it has one (HFStepError does); otherwise every unfinished request fails, and each is
aborted in the core so its KV blocks are freed. The thread logs the traceback and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from llmserve.errors import InvalidArgument, Unavailable
from llmserve.inference.engine.types import EngineCore, EngineLoad, EngineOutput, EngineRequest, ModelInfo
from llmserve.sampling import FinishReason

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _AddRequest:
    request: EngineRequest


@dataclass(slots=True)
class _AbortRequest:
    request_id: str


class _Stop:
    pass


_Command = _AddRequest | _AbortRequest | _Stop


@dataclass(slots=True)
class _Stream:
    """Loop-side state of one in-flight request."""

    outputs: asyncio.Queue[EngineOutput]
    num_unfinished_sequences: int
    is_detached: bool = False  # the consumer left; outputs are counted, not queued
    is_aborting: bool = False


@dataclass(slots=True)
class _InFlight:
    """Engine-thread-side state of one request the core holds."""

    num_prompt_tokens: int
    arrival_ns: int
    unfinished_sequence_indexes: set[int] = field(default_factory=set)


class AsyncEngine:
    """Owns an EngineCore and its thread. Every public method runs on the event loop."""

    def __init__(self, core: EngineCore):
        self._core = core
        self.model_info: ModelInfo = core.model_info
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._in_flight: dict[str, _InFlight] = {}  # engine thread only
        self._load_snapshot: EngineLoad = core.load()  # replaced by the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._is_accepting = False
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        self._is_accepting = True

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Stop accepting (Unavailable), let running requests finish for up to
        `drain_timeout_s`, abort the rest, then stop and join the engine thread."""
        self._is_accepting = False
        if self._thread is None:
            return
        if self._streams:
            try:
                await asyncio.wait_for(self._no_streams.wait(), timeout=drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("drain timeout (%.1fs): aborting %d requests", drain_timeout_s, len(self._streams))
                for request_id in list(self._streams):
                    self.abort(request_id)
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # --- requests ---------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs until every sequence has finished.

        Leaving early (break + aclose, cancellation, an exception in the consumer) aborts the
        request in the core, which frees its KV blocks.
        """
        if not self._is_accepting:
            raise Unavailable("the inference engine is shutting down")
        if request.request_id in self._streams:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already in flight")
        stream = _Stream(outputs=asyncio.Queue(), num_unfinished_sequences=request.sampling.n)
        self._streams[request.request_id] = stream
        self._no_streams.clear()
        self._commands.put(_AddRequest(request))
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
        self._commands.put(_AbortRequest(request_id))
        return True

    def load(self) -> EngineLoad:
        """The snapshot the engine thread took after its latest step; no call into the core."""
        return self._load_snapshot

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        """Runs on the loop: route outputs to their streams; retire finished requests."""
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
            self._no_streams.set()

    # --- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        is_stopping = False
        while not is_stopping:
            outputs: list[EngineOutput] = []
            try:
                is_stopping = self._run_once(outputs)
            except Exception as exc:  # noqa: BLE001 — a bug here must not strand every stream
                log.exception("engine loop iteration failed")
                outputs += self._abort_all(FinishReason.ERROR, _describe(exc, "engine loop"))
            # Snapshot before delivering, so a consumer that saw a final output reads a load
            # that already reflects it.
            self._refresh_load()
            if outputs and not self._publish(outputs):
                break
        log.info("engine thread stopped")

    def _run_once(self, outputs: list[EngineOutput]) -> bool:
        """Apply pending commands (sleeping on the queue when idle), then step once.
        Appends what it produced to `outputs`; True once a stop command arrived."""
        is_stopping = False
        for command in self._take_commands(block=not self._has_work()):
            if isinstance(command, _Stop):
                is_stopping = True
            else:
                outputs += self._apply(command)
        if is_stopping:
            outputs += self._abort_all(FinishReason.CANCELLED, "")
        elif self._has_work():
            outputs += self._step()
        return is_stopping

    def _publish(self, outputs: list[EngineOutput]) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        except RuntimeError:  # the event loop is closed: nobody is left to read
            log.warning("event loop closed; engine thread exits")
            return False
        return True

    def _take_commands(self, *, block: bool) -> list[_Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _has_work(self) -> bool:
        try:
            return self._core.has_unfinished_requests()
        except Exception:  # noqa: BLE001 — a broken core must not kill the thread
            log.exception("has_unfinished_requests failed")
            return bool(self._in_flight)

    def _apply(self, command: _Command) -> list[EngineOutput]:
        if isinstance(command, _AbortRequest):
            return self._abort(command.request_id, FinishReason.CANCELLED, "")
        request = command.request
        self._in_flight[request.request_id] = _InFlight(
            num_prompt_tokens=len(request.prompt_token_ids),
            arrival_ns=request.arrival_ns,
            unfinished_sequence_indexes=set(range(request.sampling.n)),
        )
        try:
            self._core.add_request(request)
        except Exception as exc:  # noqa: BLE001
            log.exception("add_request failed for %r", request.request_id)
            return self._abort(request.request_id, FinishReason.ERROR, _describe(exc, "add_request"))
        return []

    def _step(self) -> list[EngineOutput]:
        try:
            outputs = self._core.step()
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            failed_ids = getattr(exc, "request_ids", None) or list(self._in_flight)
            message = _describe(exc, "engine step")
            return [out for rid in failed_ids for out in self._abort(rid, FinishReason.ERROR, message)]
        for output in outputs:
            if output.is_finished:
                self._retire_sequence(output.request_id, output.sequence_index)
        return outputs

    def _retire_sequence(self, request_id: str, sequence_index: int) -> None:
        in_flight = self._in_flight.get(request_id)
        if in_flight is None:
            return
        in_flight.unfinished_sequence_indexes.discard(sequence_index)
        if not in_flight.unfinished_sequence_indexes:
            del self._in_flight[request_id]

    def _abort(self, request_id: str, reason: FinishReason, error_message: str) -> list[EngineOutput]:
        """Remove the request from the core; a final output for each unfinished sequence."""
        in_flight = self._in_flight.pop(request_id, None)
        if in_flight is None:
            return []  # already finished; its final outputs are on their way
        try:
            self._core.abort_request(request_id)
        except Exception:  # noqa: BLE001
            log.exception("abort_request failed for %r", request_id)
        total_time_ns = max(0, time.monotonic_ns() - in_flight.arrival_ns)
        return [
            EngineOutput(
                request_id=request_id,
                sequence_index=index,
                new_token_ids=[],
                finish_reason=reason,
                error_message=error_message,
                num_prompt_tokens=in_flight.num_prompt_tokens,
                total_time_ns=total_time_ns,
            )
            for index in sorted(in_flight.unfinished_sequence_indexes)
        ]

    def _abort_all(self, reason: FinishReason, error_message: str) -> list[EngineOutput]:
        return [out for rid in list(self._in_flight) for out in self._abort(rid, reason, error_message)]

    def _refresh_load(self) -> None:
        try:
            self._load_snapshot = self._core.load()
        except Exception:  # noqa: BLE001
            log.exception("load() failed; keeping the previous snapshot")


def _describe(exc: BaseException, where: str) -> str:
    return f"{where} failed: {type(exc).__name__}: {exc}"

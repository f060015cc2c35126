"""EngineThread: the one thread that drives an EngineCore, fed by commands from the event loop.

Each iteration of its loop reads top to bottom:
  1. take the queued commands (sleeping on the queue while the core has no unfinished request);
  2. apply them: add a request to the core, or abort one (CANCELLED outputs);
  3. step the core once, or, when a stop command came, cancel every unfinished request;
  4. snapshot the core's load, then hand the outputs of 2 and 3 to the event loop.

A request is *unfinished* from the add command until each of its sequences has produced its
final output here: from the core, from an abort (CANCELLED) or from a failure (ERROR). This
thread keeps that table so every sequence handed to the core gets exactly one final output.

A step that raises StepFailed fails only its `request_ids`; any other exception from the step
fails every unfinished request. Each failed request is aborted in the core, which frees its KV
blocks, and the thread logs the traceback and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.inference.engine.types import EngineCore, EngineLoad, EngineOutput, EngineRequest, StepFailed
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
class _UnfinishedRequest:
    num_prompt_tokens: int
    arrival_ns: int
    unfinished_sequence_indexes: set[int]


class EngineThread:
    """add_request, abort_request, start and stop are called from the event loop; everything
    else runs on the thread, the only caller of the core."""

    def __init__(self, core: EngineCore):
        self._core = core
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._unfinished: dict[str, _UnfinishedRequest] = {}
        self._load_snapshot: EngineLoad = core.load()  # replaced after every iteration
        self._thread: threading.Thread | None = None

    # --- event loop side --------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list[EngineOutput]], None]) -> None:
        """Start the thread; it hands every batch of outputs to `deliver`, run on `loop`."""
        self._thread = threading.Thread(target=self._run, args=(loop, deliver), name="engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """Started and not yet stopped."""
        return self._thread is not None

    def stop(self) -> None:
        """Cancel every unfinished request, then end and join the thread. Blocks."""
        self._commands.put(_Stop())
        self._thread.join()
        self._thread = None

    def add_request(self, request: EngineRequest) -> None:
        self._commands.put(_AddRequest(request))

    def abort_request(self, request_id: str) -> None:
        self._commands.put(_AbortRequest(request_id))

    def load(self) -> EngineLoad:
        """The snapshot taken after the latest iteration, before its outputs were delivered: a
        consumer that saw a final output reads a load that already counts it."""
        return self._load_snapshot

    # --- the thread -------------------------------------------------------------------------

    def _run(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list[EngineOutput]], None]) -> None:
        is_stopping = False
        while not is_stopping:
            commands = self._take_commands(block=not self._has_work())
            is_stopping = any(isinstance(command, _Stop) for command in commands)
            outputs = [output for command in commands for output in self._guarded(self._apply, command)]
            outputs += self._guarded(self._cancel_all if is_stopping else self._step)
            self._refresh_load()
            if outputs and not _call_soon(loop, deliver, outputs):
                break
        log.info("engine thread stopped")

    def _guarded(self, stage: Callable[..., list[EngineOutput]], *args) -> list[EngineOutput]:
        """Core failures are handled inside each stage; this catches our own bugs, which must
        not kill the thread and strand every stream."""
        try:
            return stage(*args)
        except Exception as exc:  # noqa: BLE001
            log.exception("engine thread: %s failed", stage.__name__)
            return self._abort_all(FinishReason.ERROR, _describe(exc, "engine loop"))

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
            return bool(self._unfinished)

    def _apply(self, command: _Command) -> list[EngineOutput]:
        if isinstance(command, _Stop):
            return []  # _run cancels what is unfinished once every command is applied
        if isinstance(command, _AbortRequest):
            return self._abort(command.request_id, FinishReason.CANCELLED, "")
        request = command.request
        self._unfinished[request.request_id] = _UnfinishedRequest(
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
        if not self._has_work():
            return []
        try:
            outputs = self._core.step()
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            failed_ids = exc.request_ids if isinstance(exc, StepFailed) else list(self._unfinished)
            message = _describe(exc, "engine step")
            return [out for rid in failed_ids for out in self._abort(rid, FinishReason.ERROR, message)]
        for output in outputs:
            if output.is_finished:
                self._finish_sequence(output.request_id, output.sequence_index)
        return outputs

    def _finish_sequence(self, request_id: str, sequence_index: int) -> None:
        unfinished = self._unfinished.get(request_id)
        if unfinished is None:
            return
        unfinished.unfinished_sequence_indexes.discard(sequence_index)
        if not unfinished.unfinished_sequence_indexes:
            del self._unfinished[request_id]

    def _abort(self, request_id: str, reason: FinishReason, error_message: str) -> list[EngineOutput]:
        """Remove the request from the core; a final output for each unfinished sequence."""
        unfinished = self._unfinished.pop(request_id, None)
        if unfinished is None:
            return []  # already finished; its final outputs are on their way
        try:
            self._core.abort_request(request_id)
        except Exception:  # noqa: BLE001
            log.exception("abort_request failed for %r", request_id)
        total_time_ns = max(0, time.monotonic_ns() - unfinished.arrival_ns)
        return [
            EngineOutput(
                request_id=request_id,
                sequence_index=index,
                new_token_ids=[],
                finish_reason=reason,
                error_message=error_message,
                num_prompt_tokens=unfinished.num_prompt_tokens,
                total_time_ns=total_time_ns,
            )
            for index in sorted(unfinished.unfinished_sequence_indexes)
        ]

    def _abort_all(self, reason: FinishReason, error_message: str) -> list[EngineOutput]:
        return [out for rid in list(self._unfinished) for out in self._abort(rid, reason, error_message)]

    def _cancel_all(self) -> list[EngineOutput]:
        return self._abort_all(FinishReason.CANCELLED, "")

    def _refresh_load(self) -> None:
        try:
            self._load_snapshot = self._core.load()
        except Exception:  # noqa: BLE001
            log.exception("load() failed; keeping the previous snapshot")


def _call_soon(loop: asyncio.AbstractEventLoop, deliver: Callable[[list[EngineOutput]], None], outputs) -> bool:
    """Schedule `deliver(outputs)` on the loop; False once the loop is closed (nobody is left
    to read, so the thread exits)."""
    try:
        loop.call_soon_threadsafe(deliver, outputs)
    except RuntimeError:
        log.warning("event loop closed; engine thread exits")
        return False
    return True


def _describe(exc: BaseException, where: str) -> str:
    return f"{where} failed: {type(exc).__name__}: {exc}"

"""EngineLoop: the loop that drives one EngineCore, wherever it runs (a thread of the server
process, engine_thread.py, or a process of its own, engine_process.py).

Each iteration reads top to bottom:
  1. take the queued commands (waiting for one while the core has no unfinished request);
  2. apply them: add a request to the core, or abort one (CANCELLED outputs);
  3. abort the requests whose deadline has passed, all at this step boundary (CANCELLED);
  4. step the core once, or, when a stop command came, cancel every unfinished request;
  5. emit the outputs of 2-4 and the prefix-cache changes they made (CacheEvents, usually
     none) with the core's load, snapshot after the step (a consumer that sees a final output
     reads a load that already counts it), and the step's StepReport when it ran a batch.

A request is *unfinished* from the add command until each of its sequences has produced its
final output here: from the core, from an abort (CANCELLED) or from a failure (ERROR). The
loop keeps that table so every sequence handed to the core gets exactly one final output.

A step that raises StepFailed fails only its `request_ids`; any other exception from the step
fails every unfinished request. Each failed request is aborted in the core, which frees its KV
blocks, and the loop logs the traceback and keeps serving.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.inference.engine.types import (
    CacheEvent, EngineCore, EngineLoad, EngineOutput, EngineRequest, StepFailed, StepReport,
)
from llmserve.sampling import DEADLINE_EXCEEDED_MESSAGE, FinishReason

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AddRequest:
    request: EngineRequest


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class Stop:
    pass


EngineCommand = AddRequest | AbortRequest | Stop

# take_commands(block) -> the queued commands; with block=True it waits for at least one.
TakeCommands = Callable[[bool], list[EngineCommand]]
# emit(outputs, load, kv_events, step) -> False when nobody is left to read them (the loop then
# ends); `step` is None when the iteration ran no batch.
Emit = Callable[[list[EngineOutput], EngineLoad, list[CacheEvent], StepReport | None], bool]
# deliver(outputs, kv_events, steps), on the event loop: what a core client hands AsyncEngine,
# one call per batch of steps it received.
Deliver = Callable[[list[EngineOutput], list[CacheEvent], list[StepReport]], None]


@dataclass(slots=True)
class _UnfinishedRequest:
    num_prompt_tokens: int
    arrival_ns: int
    unfinished_sequence_indexes: set[int]


class EngineLoop:
    """The only caller of its core: run() owns it until a Stop command has been applied."""

    def __init__(self, core: EngineCore):
        self._core = core
        self._unfinished: dict[str, _UnfinishedRequest] = {}
        self._deadlines: list[tuple[int, str]] = []  # heap of (deadline_ns, request_id)
        self._last_load: EngineLoad | None = None
        self._step_report: StepReport | None = None  # the current iteration's, set by _step

    def run(self, take_commands: TakeCommands, emit: Emit) -> None:
        is_stopping = False
        while not is_stopping:
            commands = take_commands(not self._has_work())
            is_stopping = any(isinstance(command, Stop) for command in commands)
            outputs = [output for command in commands for output in self._guarded(self._apply, command)]
            outputs += self._guarded(self._abort_expired)
            outputs += self._guarded(self._cancel_all if is_stopping else self._step)
            kv_events = self._take_kv_events()
            load = self._load()
            step, self._step_report = self._step_report, None
            is_news = outputs or kv_events or step is not None or load != self._last_load
            if is_news and not emit(outputs, load, kv_events, step):
                break
            self._last_load = load
        log.info("engine loop stopped")

    def _guarded(self, stage: Callable[..., list[EngineOutput]], *args) -> list[EngineOutput]:
        """Core failures are handled inside each stage; this catches our own bugs, which must
        not end the loop and strand every stream."""
        try:
            return stage(*args)
        except Exception as exc:  # noqa: BLE001
            log.exception("engine loop: %s failed", stage.__name__)
            return self._abort_all(FinishReason.ERROR, _describe(exc, "engine loop"))

    def _has_work(self) -> bool:
        try:
            return self._core.has_unfinished_requests()
        except Exception:  # noqa: BLE001 — a broken core must not end the loop
            log.exception("has_unfinished_requests failed")
            return bool(self._unfinished)

    def _apply(self, command: EngineCommand) -> list[EngineOutput]:
        if isinstance(command, Stop):
            return []  # run() cancels what is unfinished once every command is applied
        if isinstance(command, AbortRequest):
            return self._abort(command.request_id, FinishReason.CANCELLED, "")
        request = command.request
        self._unfinished[request.request_id] = _UnfinishedRequest(
            num_prompt_tokens=len(request.prompt_token_ids),
            arrival_ns=request.arrival_ns,
            unfinished_sequence_indexes=set(range(request.sampling.n)),
        )
        if request.deadline_ns:
            heapq.heappush(self._deadlines, (request.deadline_ns, request.request_id))
        try:
            self._core.add_request(request)
        except Exception as exc:  # noqa: BLE001
            log.exception("add_request failed for %r", request.request_id)
            return self._abort(request.request_id, FinishReason.ERROR, _describe(exc, "add_request"))
        return []

    def _abort_expired(self) -> list[EngineOutput]:
        """Every request past its deadline, aborted at this step boundary (finished requests
        leave stale heap entries, which _abort ignores)."""
        now_ns = time.monotonic_ns()
        if not self._deadlines or self._deadlines[0][0] > now_ns:
            return []
        expired: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            expired.append(heapq.heappop(self._deadlines)[1])
        outputs = [out for rid in expired for out in self._abort(rid, FinishReason.CANCELLED, DEADLINE_EXCEEDED_MESSAGE)]
        if outputs:
            log.info("aborted %d requests past their deadline", len({out.request_id for out in outputs}))
        return outputs

    def _step(self) -> list[EngineOutput]:
        if not self._has_work():
            return []
        started_s = time.perf_counter()
        try:
            outputs = self._core.step()
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            failed_ids = exc.request_ids if isinstance(exc, StepFailed) else list(self._unfinished)
            message = _describe(exc, "engine step")
            return [out for rid in failed_ids for out in self._abort(rid, FinishReason.ERROR, message)]
        self._step_report = self._report(time.perf_counter() - started_s)
        for output in outputs:
            if output.is_finished:
                self._finish_sequence(output.request_id, output.sequence_index)
        return outputs

    def _report(self, duration_s: float) -> StepReport | None:
        num_seqs = self._core.num_scheduled_seqs()
        return StepReport(duration_s, num_seqs) if num_seqs else None

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

    def _take_kv_events(self) -> list[CacheEvent]:
        try:
            return self._core.take_kv_events()
        except Exception:  # noqa: BLE001 — a broken core must not end the loop
            log.exception("take_kv_events failed")
            return []

    def _load(self) -> EngineLoad:
        try:
            return self._core.load()
        except Exception:  # noqa: BLE001
            log.exception("load() failed; keeping the previous snapshot")
            return self._last_load


def _describe(exc: BaseException, where: str) -> str:
    return f"{where} failed: {type(exc).__name__}: {exc}"

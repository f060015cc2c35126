"""EngineLoop: the loop that drives one EngineCore, wherever it runs (a thread of the server
process, engine_thread.py, or a process of its own, engine_process.py).

Each iteration reads top to bottom:
  1. take the queued commands (waiting for one while no request is in flight);
  2. apply them: add a request to the core, or abort one (CANCELLED outputs);
  3. abort the requests whose deadline has passed, all at this step boundary (DEADLINE);
  4. step the core once, or, when a stop command came, cancel every request in flight;
  5. emit the outputs of 2-4 and the prefix-cache changes they made (CacheEvents, usually
     none) with the core's load, snapshot after the step (a consumer that sees a final output
     reads a load that already counts it), and the step's StepReport when it ran a batch.
     The outputs are one StepOutputs (llmserve.engine_output): the aborts' and the step's
     EngineOutputs, then the step's plain tokens as columns, as the core returned them (a
     core that returns a list of EngineOutputs has no columns).

A request is *in flight* from the add command until each of its sequences has produced its
final output here: from the core, from an abort (CANCELLED, DEADLINE) or from a failure
(ERROR). The loop is the one owner of that state in the core's process: its table is what makes
every sequence handed to the core get exactly one final output, and what the load's request
totals count (a core keeps only its scheduling state).

A step that raises StepFailed fails only its `request_ids`; any other exception from the step
fails every request in flight. Each failed request is aborted in the core, which frees its KV
blocks, and the loop logs the traceback and keeps serving.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.engine_output import EngineOutput, StepOutputs
from llmserve.inference.engine.types import CacheEvent, EngineCore, EngineLoad, EngineRequest, StepFailed, StepReport
from llmserve.sampling import FinishReason

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


@dataclass(slots=True)
class CallCore:
    """Call one of the core's CORE_CALLS with `args`; its CoreReply comes back with the
    iteration's outputs (how the server asks the core to pin, release or pull KV blocks)."""

    call_id: int
    method: str
    args: tuple


@dataclass(slots=True)
class CoreReply:
    call_id: int
    result: object = None
    error: BaseException | None = None  # what the call raised (picklable: it may cross the pipe)


# The core methods a CallCore may name (TorchEngineCore's KV pull).
CORE_CALLS = frozenset({"kv_identity", "kv_pin", "kv_release", "kv_import", "kv_forget"})

EngineCommand = AddRequest | AbortRequest | Stop | CallCore

@dataclass(slots=True)
class Iteration:
    """What one iteration of the loop produced (what `emit` is handed)."""

    outputs: StepOutputs
    load: EngineLoad  # after the iteration, with the loop's request totals
    kv_events: list[CacheEvent]
    step: StepReport | None  # None: it ran no batch
    is_stopping: bool  # a Stop command was applied: every request was cancelled, the loop ends
    replies: list[CoreReply]  # to the iteration's CallCore commands, in order


# take_commands(block) -> the queued commands; with block=True it waits for at least one.
TakeCommands = Callable[[bool], list[EngineCommand]]
# emit(outputs, load, kv_events, step, replies) -> False when nobody is left to read them (the
# loop then ends); `step` is None when the iteration ran no batch.
Emit = Callable[[StepOutputs, EngineLoad, list[CacheEvent], StepReport | None, list[CoreReply]], bool]


@dataclass(slots=True)
class CoreUpdate:
    """What a core client hands AsyncEngine on the event loop: the iterations it received since
    the last update, merged (outputs and cache changes in order, a StepReport per batch run)."""

    outputs: list[EngineOutput]
    kv_events: list[CacheEvent]
    steps: list[StepReport]
    replies: list[CoreReply] = dataclasses.field(default_factory=list)
    # Set once, when the core is gone (its process died): every request in flight fails with it.
    core_failure: str = ""


Deliver = Callable[[CoreUpdate], None]


@dataclass(slots=True)
class _InFlightRequest:
    num_prompt_tokens: int
    arrival_ns: int
    unfinished_sequence_indexes: set[int]


class EngineLoop:
    """The only caller of its core: run() owns it until a Stop command has been applied."""

    def __init__(self, core: EngineCore):
        self._core = core
        self._in_flight: dict[str, _InFlightRequest] = {}
        self._num_finished_total = 0  # every request that ended, aborted ones included
        self._num_aborted_total = 0  # ended by an abort: a command, its deadline, a failure, a stop
        self._deadlines: list[tuple[int, str]] = []  # heap of (deadline_ns, request_id)
        self._last_load: EngineLoad | None = None
        self._step_report: StepReport | None = None  # the current iteration's, set by _step
        self._replies: list[CoreReply] = []  # the current iteration's, set by _apply
        self._previous_step_ended_s: float | None = None  # None: the loop has waited since

    def run(self, take_commands: TakeCommands, emit: Emit) -> None:
        """Iterate until a Stop command has been applied (or nobody reads what is emitted)."""
        while True:
            is_idle = not self._has_work()
            if is_idle:
                self._previous_step_ended_s = None  # the wait is not part of the next step's period
            commands = take_commands(is_idle)
            iteration = self.iterate(commands)
            is_news = iteration.outputs or iteration.kv_events or iteration.step is not None or iteration.replies
            if (is_news or iteration.load != self._last_load) and not emit(
                iteration.outputs, iteration.load, iteration.kv_events, iteration.step, iteration.replies
            ):
                break
            self._last_load = iteration.load
            if iteration.is_stopping:
                break
        log.info("engine loop stopped")

    def iterate(self, commands: list[EngineCommand]) -> Iteration:
        """One iteration (steps 2-5 of the module docstring) on `commands`."""
        is_stopping = any(isinstance(command, Stop) for command in commands)
        outputs = [output for command in commands for output in self._guarded(self._apply, command)]
        outputs += self._guarded(self._abort_expired)
        stepped = StepOutputs.of(self._guarded(self._cancel_all if is_stopping else self._step))
        kv_events = self._take_kv_events()
        step, self._step_report = self._step_report, None
        replies, self._replies = self._replies, []
        outputs = StepOutputs(outputs + stepped.outputs, stepped.tokens)
        return Iteration(outputs, self._load(), kv_events, step, is_stopping, replies)

    @property
    def has_work(self) -> bool:
        """A request is in flight in the core: the next iteration steps it."""
        return self._has_work()

    def _guarded(self, stage: Callable[..., list[EngineOutput] | StepOutputs], *args) -> list[EngineOutput] | StepOutputs:
        """Core failures are handled inside each stage; this catches our own bugs, which must
        not end the loop and strand every stream."""
        try:
            return stage(*args)
        except Exception as exc:  # noqa: BLE001
            log.exception("engine loop: %s failed", stage.__name__)
            return self._abort_all(FinishReason.ERROR, _describe(exc, "engine loop"))

    def _has_work(self) -> bool:
        try:
            return self._core.has_requests_in_flight()
        except Exception:  # noqa: BLE001 — a broken core must not end the loop
            log.exception("has_requests_in_flight failed")
            return bool(self._in_flight)

    def _apply(self, command: EngineCommand) -> list[EngineOutput]:
        if isinstance(command, Stop):
            return []  # run() cancels what is in flight once every command is applied
        if isinstance(command, AbortRequest):
            return self._abort(command.request_id, FinishReason.CANCELLED, "")
        if isinstance(command, CallCore):
            self._replies.append(self._call(command))
            return []
        request = command.request
        self._in_flight[request.request_id] = _InFlightRequest(
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

    def _call(self, command: CallCore) -> CoreReply:
        return answer_call(self._core, command)

    def _abort_expired(self) -> list[EngineOutput]:
        """Every request past its deadline, aborted at this step boundary (finished requests
        leave stale heap entries, which _abort ignores)."""
        now_ns = time.monotonic_ns()
        if not self._deadlines or self._deadlines[0][0] > now_ns:
            return []
        expired: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            expired.append(heapq.heappop(self._deadlines)[1])
        outputs = [out for rid in expired for out in self._abort(rid, FinishReason.DEADLINE, "")]
        if outputs:
            log.info("aborted %d requests past their deadline", len({out.request_id for out in outputs}))
        return outputs

    def _step(self) -> list[EngineOutput] | StepOutputs:
        if not self._has_work():
            return []
        started_s = time.perf_counter()
        try:
            outputs = self._core.step()
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            failed_ids = exc.request_ids if isinstance(exc, StepFailed) else list(self._in_flight)
            message = _describe(exc, "engine step")
            return [out for rid in failed_ids for out in self._abort(rid, FinishReason.ERROR, message)]
        ended_s = time.perf_counter()
        previous_ended_s, self._previous_step_ended_s = self._previous_step_ended_s, ended_s
        period_s = None if previous_ended_s is None else ended_s - previous_ended_s
        self._step_report = self._report(ended_s - started_s, period_s)
        outputs = StepOutputs.of(outputs)
        for output in outputs.outputs:  # a final output is never a plain token
            if output.is_finished:
                self._finish_sequence(output.request_id, output.sequence_index)
        return outputs

    def _report(self, duration_s: float, period_s: float | None) -> StepReport | None:
        num_seqs, num_tokens = self._core.scheduled_batch()
        return StepReport(duration_s, num_seqs, num_tokens, period_s) if num_seqs else None

    def _finish_sequence(self, request_id: str, sequence_index: int) -> None:
        in_flight = self._in_flight.get(request_id)
        if in_flight is None:
            return
        in_flight.unfinished_sequence_indexes.discard(sequence_index)
        if not in_flight.unfinished_sequence_indexes:
            del self._in_flight[request_id]
            self._num_finished_total += 1

    def _abort(self, request_id: str, reason: FinishReason, error_message: str) -> list[EngineOutput]:
        """Remove the request from the core; a final output for each unfinished sequence."""
        in_flight = self._in_flight.pop(request_id, None)
        if in_flight is None:
            return []  # already finished; its final outputs are on their way
        self._num_finished_total += 1
        self._num_aborted_total += 1
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

    def _cancel_all(self) -> list[EngineOutput]:
        return self._abort_all(FinishReason.CANCELLED, "")

    def _take_kv_events(self) -> list[CacheEvent]:
        try:
            return self._core.take_kv_events()
        except Exception:  # noqa: BLE001 — a broken core must not end the loop
            log.exception("take_kv_events failed")
            return []

    def _load(self) -> EngineLoad:
        """The core's load with this loop's request totals."""
        try:
            load = self._core.load()
        except Exception:  # noqa: BLE001
            log.exception("load() failed; keeping the previous snapshot")
            return self._last_load
        return dataclasses.replace(
            load, num_finished_total=self._num_finished_total, num_aborted_total=self._num_aborted_total
        )


def picklable_error(exc: BaseException) -> BaseException:
    """`exc`, or a RuntimeError saying what it was when it cannot cross a pipe."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def answer_call(core: EngineCore, command: CallCore) -> CoreReply:
    """A CallCore's answer; what it raised is the answer when it fails (the caller decides)."""
    if command.method not in CORE_CALLS or not hasattr(core, command.method):
        return CoreReply(command.call_id, error=NotImplementedError(f"this engine core has no {command.method}"))
    try:
        return CoreReply(command.call_id, getattr(core, command.method)(*command.args))
    except Exception as exc:  # noqa: BLE001 — answered, not fatal to the loop
        if not hasattr(exc, "reason"):
            log.exception("core call %s failed", command.method)
        return CoreReply(command.call_id, error=picklable_error(exc))


def _describe(exc: BaseException, where: str) -> str:
    return f"{where} failed: {type(exc).__name__}: {exc}"

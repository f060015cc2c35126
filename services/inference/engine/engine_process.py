"""EngineProcess: an EngineLoop in a process of its own, fed and drained through two pipes.

    server process (event loop)                           engine-core process
    add_request/abort_request ─▶ CommandPipe ─pipe─▶  take_commands ─▶ EngineLoop
    deliver(CoreUpdate)           ◀─ loop.add_reader ◀pipe─  emit: one message per step
                                        (that step's outputs, load, cache changes, StepReport)

Why a process: on a thread, the step loop and gRPC serving share one GIL, and at 256 streams
each needs 35-60% of a core (measured on the H200, issue 9): the GPU waited on Python. Here
the core's host work (schedule, update, sampling bookkeeping) has a core to itself.

Why this channel: one message per engine step carries every output of that step, so the
cost per token is a few entries of flat lists in a pickle, not a message. Plain tokens, the
common case, travel as the step's columns (llmserve.engine_output.TokenColumns: three lists,
request ids, sequence indexes, token ids), as the core produced them; outputs that carry more
(finishes, logprobs, errors) as EngineOutputs. Measured at 256 outputs (issue 19,
bench_host_step's emit): a tuple per output, built and pickled, 87 µs; the columns 31 µs; the
dataclass per output was 620 µs. Prefix-cache changes travel as they
were recorded, ints in tuples and lists (types.CacheEvent): an empty list in a step without
any. The step's StepReport (its duration, period, batch size and tokens: four numbers) is what the server's
metrics need beyond the outputs: every Prometheus object lives in the server process.
Commands are pickled and written on the event loop by a CommandPipe (engine/command_pipe.py),
which never blocks it: what a full pipe (the core busy in a step) does not take waits in a
buffer flushed as room appears.

A core with step windows (the torch core) also answers the few calls that need no step
boundary (a KV pin) on a thread of its own, read from a third pipe, with replies on a fourth:
engine/mid_step_calls.py.

The core is built in the child (weights, KV pool, CUDA graphs): the server process never
imports torch's device state, and a CUDA context is never forked (the child is spawned).
If the child dies, the update says so (CoreUpdate.core_failure): AsyncEngine, which owns the
requests, ends every one in flight with ERROR, and the engine stops accepting.

Tensor parallelism (config.tensor_parallel_size N > 1): the engine-core process is rank 0 and
the server spawns ranks 1..N-1 beside it (engine/rank_processes.py). The server watches every
rank's process: when one ends while serving, the engine fails as if the core had died, the
message naming the rank, and the other ranks are ended (they would wait in a collective).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.command_pipe import CommandPipe
from llmserve.inference.engine.engine_loop import (
    AbortRequest, AddRequest, CallCore, CoreReply, CoreUpdate, Deliver, Emit, EngineCommand, EngineLoop, Stop,
    picklable_error,
)
from llmserve.engine_output import EngineOutput, StepOutputs, TokenColumns
from llmserve.inference.engine.mid_step_calls import StepWindows, start_call_thread
from llmserve.inference.engine.queued_client import QueuedCoreClient
from llmserve.inference.engine.rank_processes import RankProcesses
from llmserve.inference.engine.rank_worker import check_tensor_parallel
from llmserve.inference.engine.types import CacheEvent, EngineLoad, EngineRequest, ModelInfo, StepReport
from llmserve.observability import ObservabilityConfig
from llmserve.server import configure_logging

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

# A step's outputs on the pipe: its EngineOutputs, and its plain tokens' columns (TokenColumns.as_tuple).
_WireOutputs = tuple[list[EngineOutput], tuple[list[str], list[int], list[int]]]


@dataclass(slots=True)
class _Ready:
    model_info: ModelInfo
    load: EngineLoad
    serves_mid_step_calls: bool = False  # a core with step windows (mid_step_calls.py)


@dataclass(slots=True)
class _StartFailed:
    error: BaseException


class EngineProcess(QueuedCoreClient):
    """Construction spawns the process and waits until its core is built (raises what the
    build raised). Then the face of EngineThread: start/stop/add_request/abort_request/load,
    called from the event loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        log_level: str = "INFO",
        observability: ObservabilityConfig = ObservabilityConfig(),
    ):
        check_tensor_parallel(config)
        context = multiprocessing.get_context("spawn")
        command_reader, self._command_writer = context.Pipe(duplex=False)
        self._output_reader, output_writer = context.Pipe(duplex=False)
        # Mid-step calls (engine/mid_step_calls.py): their own pipes, read by a thread of the core.
        call_reader, self._call_writer = context.Pipe(duplex=False)
        self._reply_reader, reply_writer = context.Pipe(duplex=False)
        self._ranks = (
            RankProcesses(config, context, log_level, observability) if config.tensor_parallel_size > 1 else None
        )
        self._process = context.Process(
            target=run_engine_process,
            args=(config, log_level, observability, command_reader, output_writer,
                  self._ranks.store_path if self._ranks else None, (call_reader, reply_writer)),
            name="engine-core",
        )  # fmt: skip
        self._process.start()
        for child_end in (command_reader, output_writer, call_reader, reply_writer):
            child_end.close()
        try:
            ready = self._wait_until_ready()
        except BaseException:
            self._end_ranks()
            raise
        super().__init__(ready.model_info, ready.load)
        self._serves_mid_step_calls = ready.serves_mid_step_calls
        self._pipe: CommandPipe | None = None  # made by start, on the event loop
        self._call_pipe: CommandPipe | None = None  # likewise, for mid-step calls
        self._is_running = False

    def _wait_until_ready(self) -> _Ready:
        while not self._output_reader.poll(0.5):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine-core process exited with code {self._process.exitcode} while starting")
            if self._ranks is not None and self._ranks.dead_rank():
                self._process.kill()
                raise RuntimeError(f"{self._ranks.dead_rank()} while starting")
        message = self._output_reader.recv()
        if isinstance(message, _StartFailed):
            self._process.join()
            raise message.error
        return message

    # --- event loop side --------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self._event_loop, self._deliver = loop, deliver
        loop.add_reader(self._output_reader.fileno(), self._on_readable)
        loop.add_reader(self._reply_reader.fileno(), self._on_replies)
        for sentinel in self._ranks.sentinels if self._ranks else ():
            loop.add_reader(sentinel, self._on_rank_exit)
        self._pipe = CommandPipe(self._command_writer, loop)
        self._call_pipe = CommandPipe(self._call_writer, loop)
        self._is_running = True
        log.info("engine core runs in process %d", self._process.pid)

    @property
    def is_running(self) -> bool:
        return self._is_running

    async def stop(self) -> None:
        """Cancel every request in flight, then end the process and wait for it (off the event
        loop, which must keep running to receive the CANCELLED outputs)."""
        self._is_running = False  # from here a rank's exit is the stop's, not a failure
        self._pipe.send(Stop())
        await asyncio.to_thread(self._process.join)
        if self._ranks is not None:
            self._stop_watching_ranks()
            await asyncio.to_thread(self._ranks.join)

    def add_request(self, request: EngineRequest) -> None:
        self._pipe.send(AddRequest(request))

    def abort_request(self, request_id: str) -> None:
        self._pipe.send(AbortRequest(request_id))

    def call_core(self, call: CallCore) -> None:
        self._pipe.send(call)

    def call_core_mid_step(self, call: CallCore) -> None:
        """`call` (one of mid_step_calls.MID_STEP_CALLS) answered by the core's call thread in
        the loop's next window, not after the step in progress; between steps by a core
        without windows."""
        (self._call_pipe if self._serves_mid_step_calls else self._pipe).send(call)

    def _on_replies(self) -> None:
        """Mid-step replies, each with the core's load after it (a pin's blocks count as used):
        the newest snapshot until the loop's next iteration reports one."""
        update = CoreUpdate([], [], [])
        try:
            while self._reply_reader.poll():
                reply, self._load_snapshot = self._reply_reader.recv()
                update.replies.append(reply)
        except (EOFError, OSError):  # the process ended: the output pipe's reader reports it
            self._event_loop.remove_reader(self._reply_reader.fileno())
        if update.replies:
            self._deliver(update)

    def _on_readable(self) -> None:
        update = CoreUpdate([], [], [])
        try:
            while self._output_reader.poll():
                wire_outputs, self._load_snapshot, step_kv_events, step, replies = self._output_reader.recv()
                update.outputs += from_wire(wire_outputs)
                update.kv_events += step_kv_events
                update.replies += replies
                if step is not None:
                    update.steps.append(step)
        except (EOFError, OSError):
            self._on_process_exit(update)
        if update.outputs or update.kv_events or update.steps or update.replies or update.core_failure:
            self._deliver(update)

    def _on_process_exit(self, update: CoreUpdate) -> None:
        """The pipe closed: after a stop (which cancelled everything first, so nothing is left
        to fail) or because the process died (what is still in flight fails)."""
        self._stop_reading_pipes()
        if not self._is_running:
            return  # stopped: what stop() waits for
        dead_rank = self._ranks.dead_rank() if self._ranks is not None else ""
        update.core_failure = dead_rank or "the engine-core process died"
        self._is_running = False
        if self._ranks is not None:
            self._stop_watching_ranks()
            self._end_ranks()

    def _on_rank_exit(self) -> None:
        """A rank's process ended. While serving, the engine cannot go on without it: the core
        process and the other ranks are ended and every request in flight fails."""
        self._stop_watching_ranks()
        if not self._is_running:
            return
        self._stop_reading_pipes()
        self._is_running = False
        failure = self._ranks.dead_rank()
        log.error("%s: the engine stops", failure)
        self._process.kill()
        self._end_ranks()
        self._event_loop.run_in_executor(None, self._process.join)  # reap it off the loop
        self._deliver(CoreUpdate([], [], [], core_failure=failure))

    def _stop_reading_pipes(self) -> None:
        for reader in (self._output_reader, self._reply_reader):
            self._event_loop.remove_reader(reader.fileno())

    def _stop_watching_ranks(self) -> None:
        for sentinel in self._ranks.sentinels:
            self._event_loop.remove_reader(sentinel)

    def _end_ranks(self) -> None:
        if self._ranks is not None:
            self._ranks.end()


# --- the engine-core process ----------------------------------------------------------------


def run_engine_process(
    config: EngineConfig, log_level: str, observability: ObservabilityConfig, commands: Connection, outputs: Connection,
    rank_store_path: str | None = None, mid_step: tuple[Connection, Connection] | None = None,
) -> None:
    """The process's main: build the core, then run the loop until Stop (or the server process
    goes away). `rank_store_path`: tensor parallelism's rendezvous; this process is rank 0.
    `mid_step`: the (calls, replies) pipes of mid-step calls, answered by a thread beside the loop."""
    exit_with_parent()
    configure_logging("engine-core", log_level, observability)
    from llmserve.inference.engine.cores import create_engine_core  # the child's imports, not the server's

    try:
        core = create_engine_core(config, rank_store_path)
    except BaseException as exc:  # noqa: BLE001 — reported to the server, which decides
        outputs.send(_StartFailed(picklable_error(exc)))
        return
    windows = None
    if mid_step is not None and config.mid_step_calls and hasattr(core, "open_windows"):
        windows = StepWindows()
        windows.hold()  # this thread's, outside its windows
        core.open_windows(windows)
        start_call_thread(*mid_step, core, windows)
    outputs.send(_Ready(core.model_info, core.load(), serves_mid_step_calls=windows is not None))
    EngineLoop(core).run(_command_taker(commands, windows), _emitter(outputs))
    if rank_store_path is not None:
        from llmserve.inference.models.rank_group import exit_without_teardown

        core.stop_ranks()
        outputs.close()
        exit_without_teardown()


def _command_taker(commands: Connection, windows: StepWindows | None = None) -> Callable[[bool], list[EngineCommand]]:
    """Waiting for a command while idle is a window for mid-step calls."""
    idle_window = windows.open if windows is not None else contextlib.nullcontext

    def take_commands(block: bool) -> list[EngineCommand]:
        taken: list[EngineCommand] = []
        try:
            if block:
                with idle_window():
                    taken.append(commands.recv())
            while commands.poll():
                taken.append(commands.recv())
        except (EOFError, OSError):  # the server process is gone: cancel everything, end
            taken.append(Stop())
        return taken

    return take_commands


def _emitter(outputs: Connection) -> Emit:
    def emit(
        step_outputs: StepOutputs, load: EngineLoad, kv_events: list[CacheEvent], step: StepReport | None,
        replies: list[CoreReply],
    ) -> bool:
        try:
            outputs.send((to_wire(step_outputs), load, kv_events, step, replies))
        except (BrokenPipeError, OSError):
            return False
        return True

    return emit


def to_wire(outputs: StepOutputs) -> _WireOutputs:
    """What the pipe carries of a step's outputs (pickled with the rest of the message)."""
    return outputs.outputs, outputs.tokens.as_tuple()


def from_wire(wire: _WireOutputs) -> list[EngineOutput]:
    """The step's outputs as the server process's consumers read them: the EngineOutputs, then
    one per plain token."""
    objects, columns = wire
    return objects + TokenColumns(*columns).outputs() if columns[2] else objects


def exit_with_parent() -> None:
    """SIGTERM when the server process dies, even by SIGKILL: a GPU must not stay held."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

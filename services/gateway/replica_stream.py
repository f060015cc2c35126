"""ReplicaStream: every request of this gateway process to one replica, on one Multiplex call.

    GenerationPipeline ─generate()─▶ command queue ─writer task─▶ Multiplex call ─▶ replica
    MultiplexedTokens ◀─ per-request buffer ◀─reader task─ MultiplexResponse (a step's outputs)

The call asks for plain tokens as columns (pb.MULTIPLEX_COLUMNS_METADATA: a message's
TokenColumns, issue 19), which the reader hands to each request's buffer as EngineOutputs
without a protobuf object per output; a replica that does not know them sends RequestOutputs,
which are read as before.

The call opens on first use and lives as long as the gateway. If it breaks (the replica
restarts, the connection drops), each request on it fails with the status the call ended with
(UNAVAILABLE for a lost connection, or the error `fail_all` was given when the gateway gave up on
the replica), and the next request opens a new call.

Why one writer task: grpc.aio allows one write in flight per call, and requests start from
many handler tasks. Why per-request buffers: the reader must never wait on one slow request.

The buffer is also where a slow client is coalesced and bounded, the one place in the gateway:
its handler takes from it only when it is ready to write to its client, and takes *everything*
that arrived since it last took, merged into one output (llmserve.engine_output.coalesced), so
at light load each write carries one step's tokens and a client slower than generation gets
fewer, larger messages, detokenized once each. When more tokens wait in a buffer than the
bounds allow, or its oldest output has waited too long (gateway.slow_reader), the request is
aborted (an abort on the stream frees its KV blocks at once) and its stream ends with
ClientNotReading as soon as grpc lets its handler run again (when the client reads what its
HTTP/2 window holds, or cancels). Why a bound: grpc.aio's `yield` from a server-streaming
handler returns once the message is inside the client's HTTP/2 receive window, then blocks
until the client reads; without a bound a client that never reads keeps its sequence
generating to max_tokens and its KV blocks held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from google.rpc import status_pb2

from llmserve.bidi_stream import write_queued
from llmserve.engine_output import EngineOutput, coalesced
from llmserve.errors import ServiceError, Unavailable
from llmserve.gateway.hop_errors import error_from_broken_stream, error_from_status
from llmserve.gateway.metrics import record_client_not_reading
from llmserve.gateway.slow_reader import ClientNotReading, SlowReaderBounds
from llmserve.gateway.stream_interval import NO_INTERVAL, StreamInterval
from llmserve.pb import MULTIPLEX_COLUMNS_METADATA, output_from_pb
from llmserve.request_context import context_without_request
from llmserve.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

# forget(request_id, abort): the connection stops routing the request's outputs, and with
# `abort` asks the replica to abort it.
Forget = Callable[[str, bool], None]


class MultiplexedTokens:
    """One request's outputs from a ReplicaStream: iterate for EngineOutputs (everything that
    arrived since the previous one, merged), `cancel` to stop it; `bounds` say when its client
    counts as not reading; `interval_s()`: the least time between this take and the next, asked
    after each take (gateway.stream_interval: what arrives meanwhile is taken, and written,
    together; 0: none)."""

    def __init__(self, request_id: str, forget: Forget, bounds: SlowReaderBounds = SlowReaderBounds(),
                 *, num_sequences: int = 1, interval_s: Callable[[], float] = NO_INTERVAL.always):
        self.request_id = request_id
        self._forget = forget
        self._bounds = bounds
        self._interval_s = interval_s
        # The request ends with its last sequence's final output (sampling.n of them).
        self._num_sequences = num_sequences
        self._num_finished_pushed = 0
        self._num_finished_taken = 0
        # Arrived, not yet taken: as the replica sent them, or plain tokens already read (columns).
        self._outputs: list[inference_pb2.RequestOutput | EngineOutput] = []
        self._num_unsent_tokens = 0
        # loop.time() when the oldest output still waiting arrived (None: none waits). A timer
        # checks it max_unread_s after it was armed and re-arms for what is left; a take only
        # clears the time. Why not a timer per wait, cancelled at each take: at one output per
        # step per request, its call_later and cancel cost more than the rest of the buffer.
        self._first_unread_s: float | None = None
        self._unread_timer: asyncio.TimerHandle | None = None
        self._failure: ServiceError | None = None  # the connection broke: after what arrived
        self._overflow: ClientNotReading | None = None  # the bound: instead of what arrived
        self._has_news = asyncio.Event()
        self._is_done = False

    def push(self, output: inference_pb2.RequestOutput) -> bool:
        """An output arrived (on the reader task); over the bound, abort the request. True when
        it is the request's last (an error, or the final output of its last sequence)."""
        if output.error_status or output.output.finish_reason:
            self._num_finished_pushed += 1
        is_last = bool(output.error_status) or self._num_finished_pushed >= self._num_sequences
        self._buffer(output, len(output.output.token_ids))
        return is_last

    def push_tokens(self, sequence_index: int, token_ids: list[int]) -> None:
        """Plain tokens of one sequence arrived as a row of a message's TokenColumns (never the
        request's last output)."""
        self._buffer(EngineOutput(self.request_id, sequence_index, token_ids), len(token_ids))

    def _buffer(self, output: inference_pb2.RequestOutput | EngineOutput, num_tokens: int) -> None:
        if self._overflow is not None:
            return
        if self._first_unread_s is None and self._bounds.max_unread_s > 0:
            self._first_unread_s = self._arm_unread_timer()
        self._outputs.append(output)
        self._num_unsent_tokens += num_tokens
        if 0 < self._bounds.max_unsent_tokens < self._num_unsent_tokens:
            self._overflow_with(ClientNotReading.too_many_tokens(self._num_unsent_tokens, self._bounds.max_unsent_tokens))
        self._has_news.set()

    def fail(self, error: ServiceError) -> None:
        self._failure = error
        self._has_news.set()

    def _arm_unread_timer(self) -> float:
        """Now (loop time), with the timer armed if it is not."""
        loop = asyncio.get_running_loop()
        if self._unread_timer is None:
            self._unread_timer = loop.call_later(self._bounds.max_unread_s, self._on_unread)
        return loop.time()

    def _stop_unread_timer(self) -> None:
        self._first_unread_s = None
        if self._unread_timer is not None:
            self._unread_timer.cancel()
            self._unread_timer = None

    def _on_unread(self) -> None:
        """max_unread_s since the timer was armed: if the oldest waiting output waited that long,
        the handler's write has been blocked that long on the client's full window; if a younger
        one waits, check again when it will have."""
        self._unread_timer = None
        if self._overflow is not None or self._is_done or self._first_unread_s is None:
            return
        loop = asyncio.get_running_loop()
        waited_s = loop.time() - self._first_unread_s
        if waited_s < self._bounds.max_unread_s:
            self._unread_timer = loop.call_later(self._bounds.max_unread_s - waited_s, self._on_unread)
            return
        self._overflow_with(ClientNotReading.unread_too_long(self._bounds.max_unread_s, self._num_unsent_tokens))
        self._has_news.set()

    def _overflow_with(self, error: ClientNotReading) -> None:
        """Abort the request on the replica now; its stream ends with `error` once grpc lets it."""
        self._stop_unread_timer()
        self._overflow = error
        log.warning("request %s aborted: %s", self.request_id, error.message)
        record_client_not_reading(error.bound)
        self._forget(self.request_id, True)

    async def __aiter__(self) -> AsyncIterator[EngineOutput]:
        try:
            while not self._is_done:
                await self._has_news.wait()
                self._has_news.clear()
                if self._overflow is not None:
                    self._is_done = True
                    raise self._overflow
                taken_s = time.monotonic()
                outputs, error = self._take()
                for output in outputs:
                    if output.is_finished:
                        self._num_finished_taken += 1
                        self._is_done = self._num_finished_taken >= self._num_sequences
                    yield output
                if error is not None:
                    self._is_done = True
                    raise error
                if self._failure is not None and not self._is_done:
                    raise self._failure
                interval_s = self._interval_s()
                if interval_s and not self._is_done:
                    # What arrives meanwhile goes in the next take, `interval_s` after this one.
                    await asyncio.sleep(max(0.0, taken_s + interval_s - time.monotonic()))
        finally:
            self._stop_unread_timer()  # an armed timer would keep the ended request alive

    def _take(self) -> tuple[list[EngineOutput], ServiceError | None]:
        """What arrived since the last take, coalesced, and the status the replica ended the
        request with, if it did (only ever after the outputs before it)."""
        taken, self._outputs = self._outputs, []
        self._num_unsent_tokens = 0
        self._first_unread_s = None  # the armed timer, if any, finds nothing waiting or re-arms
        outputs, error = [], None
        for output in taken:
            if isinstance(output, EngineOutput):
                outputs.append(output)
                continue
            if output.error_status:
                error = error_from_status("inference", status_pb2.Status.FromString(output.error_status))
                break
            outputs.append(output_from_pb(self.request_id, output.output))
        return coalesced(outputs), error

    def cancel(self) -> None:
        """Stop the request on the replica (an abort on the stream); harmless once it ended."""
        self._stop_unread_timer()
        self._forget(self.request_id, not self._is_done)
        self._is_done = True


def push_token_columns(requests: dict[str, MultiplexedTokens], columns: inference_pb2.TokenColumns) -> None:
    """Each row of a message's TokenColumns to its request's buffer (a sequence is in one
    message's columns at most once, after that message's `outputs`)."""
    token_ids = list(columns.token_ids)
    start = 0
    for request_id, sequence_index, num_tokens in zip(columns.request_ids, columns.sequence_indexes, columns.num_tokens):
        end = start + num_tokens
        tokens = requests.get(request_id)
        if tokens is not None:
            tokens.push_tokens(sequence_index, token_ids[start:end])
        start = end


@dataclass
class _Connection:
    """One Multiplex call, its requests and the tasks that write and read it."""

    call: grpc.aio.StreamStreamCall
    commands: asyncio.Queue = field(default_factory=asyncio.Queue)
    requests: dict[str, MultiplexedTokens] = field(default_factory=dict)
    is_broken: bool = False
    writer: asyncio.Task | None = None
    # Set when the gateway itself ends the call (the replica is gone): what its requests end with.
    failure: ServiceError | None = None

    def forget(self, request_id: str, abort: bool) -> None:
        if self.requests.pop(request_id, None) is not None and abort and not self.is_broken:
            self.commands.put_nowait(
                inference_pb2.MultiplexRequest(abort=inference_pb2.AbortRequest(request_id=request_id))
            )


class ReplicaStream:
    def __init__(self, stub: inference_pb2_grpc.InferenceServiceStub, bounds: SlowReaderBounds = SlowReaderBounds(),
                 stream_interval: StreamInterval = NO_INTERVAL):
        self._stub = stub
        self._bounds = bounds
        self._stream_interval = stream_interval
        self._connection: _Connection | None = None
        self._tasks: set[asyncio.Task] = set()
        self.last_response_s = 0.0  # time.monotonic() of the last message from the replica

    def generate(self, request: inference_pb2.GenerateTokensRequest) -> MultiplexedTokens:
        connection = self._open_connection()
        num_sequences = request.sampling.n if request.sampling.HasField("n") else 1
        tokens = MultiplexedTokens(request.request_id, connection.forget, self._bounds, num_sequences=num_sequences,
                                   interval_s=lambda: self._stream_interval.at(len(connection.requests)))
        connection.requests[request.request_id] = tokens
        connection.commands.put_nowait(inference_pb2.MultiplexRequest(generate=request))
        return tokens

    def fail_all(self, error: ServiceError) -> None:
        """End the call and every request on it with `error` (the replica stopped answering)."""
        if self._connection is not None and not self._connection.is_broken:
            self._connection.failure = error
            self._connection.call.cancel()

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.call.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._connection = None

    def _open_connection(self) -> _Connection:
        if self._connection is None or self._connection.is_broken:
            connection = _Connection(call=self._stub.Multiplex(metadata=(MULTIPLEX_COLUMNS_METADATA,)))
            connection.writer = self._spawn(write_queued(connection.call, connection.commands, "Multiplex"))
            self._spawn(self._read(connection))
            self._connection = connection
        return self._connection

    def _spawn(self, work) -> asyncio.Task:
        # Opened by whichever request came first, the connection serves them all: its lines
        # must not carry that first request's id.
        task = asyncio.get_running_loop().create_task(work, context=context_without_request())
        self._tasks.add(task)  # kept so it is not garbage-collected mid-flight
        task.add_done_callback(self._tasks.discard)
        return task

    async def _read(self, connection: _Connection) -> None:
        failure: ServiceError = Unavailable("inference ended the multiplexed stream")
        try:
            async for response in connection.call:
                self.last_response_s = time.monotonic()
                for output in response.outputs:
                    tokens = connection.requests.get(output.request_id)
                    if tokens is not None and tokens.push(output):
                        del connection.requests[output.request_id]
                if response.tokens.request_ids:
                    push_token_columns(connection.requests, response.tokens)
        except grpc.aio.AioRpcError as error:
            failure = error_from_broken_stream("inference", error)
            if error.code() != grpc.StatusCode.CANCELLED:
                log.warning("Multiplex stream to inference failed: %s: %s", error.code().name, error.details())
        finally:
            connection.is_broken = True
            connection.writer.cancel()
            for tokens in list(connection.requests.values()):
                tokens.fail(connection.failure or failure)
            connection.requests.clear()

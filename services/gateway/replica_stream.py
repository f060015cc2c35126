"""ReplicaStream: every request of this gateway process to one replica, on one Multiplex call.

    GenerationPipeline ─generate()─▶ command queue ─writer task─▶ Multiplex call ─▶ replica
    MultiplexedTokens ◀─ per-request buffer ◀─reader task─ MultiplexResponse (a step's outputs)

The call opens on first use and lives as long as the gateway. If it breaks (the replica
restarts, the connection drops), each request on it fails with the status the call ended with
(UNAVAILABLE for a lost connection, or the error `fail_all` was given when the gateway gave up on
the replica), and the next request opens a new call.

Why one writer task: grpc.aio allows one write in flight per call, and requests start from
many handler tasks. Why per-request buffers: the reader must never wait on one slow request;
a request that reads late gets all it missed as one chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from google.rpc import status_pb2

from llmserve.errors import ServiceError, Unavailable
from llmserve.gateway.hop_errors import error_from_rpc, error_from_status
from llmserve.gateway.token_chunks import TokenChunk, chunk_from_pb, joined_chunks
from llmserve.request_context import context_without_request
from llmserve.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)


class MultiplexedTokens:
    """One request's outputs from a ReplicaStream: iterate for TokenChunks, `cancel` to stop it."""

    def __init__(self, request_id: str, connection: "_Connection"):
        self.request_id = request_id
        self._connection = connection
        self._outputs: list[inference_pb2.RequestOutput] = []
        self._failure: ServiceError | None = None
        self._has_news = asyncio.Event()
        self._is_done = False

    def push(self, output: inference_pb2.RequestOutput) -> None:
        self._outputs.append(output)
        self._has_news.set()

    def fail(self, error: ServiceError) -> None:
        self._failure = error
        self._has_news.set()

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        while not self._is_done:
            await self._has_news.wait()
            self._has_news.clear()
            outputs, self._outputs = self._outputs, []
            chunks = [self._chunk(output) for output in outputs]
            if chunks:
                chunk = joined_chunks(chunks)
                self._is_done = chunk.is_finished
                yield chunk
            if self._failure is not None and not self._is_done:
                raise self._failure

    def _chunk(self, output: inference_pb2.RequestOutput) -> TokenChunk:
        if output.error_status:
            self._is_done = True
            raise error_from_status("inference", status_pb2.Status.FromString(output.error_status))
        return chunk_from_pb(output.output)

    def cancel(self) -> None:
        """Stop the request on the replica (an abort on the stream); harmless once it ended."""
        self._connection.forget(self.request_id, abort=not self._is_done)
        self._is_done = True


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

    def forget(self, request_id: str, *, abort: bool) -> None:
        if self.requests.pop(request_id, None) is not None and abort and not self.is_broken:
            self.commands.put_nowait(
                inference_pb2.MultiplexRequest(abort=inference_pb2.AbortRequest(request_id=request_id))
            )


class ReplicaStream:
    def __init__(self, stub: inference_pb2_grpc.InferenceServiceStub):
        self._stub = stub
        self._connection: _Connection | None = None
        self._tasks: set[asyncio.Task] = set()
        self.last_response_s = 0.0  # time.monotonic() of the last message from the replica

    def generate(self, request: inference_pb2.GenerateTokensRequest) -> MultiplexedTokens:
        connection = self._open_connection()
        tokens = MultiplexedTokens(request.request_id, connection)
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
            connection = _Connection(call=self._stub.Multiplex())
            connection.writer = self._spawn(self._write(connection))
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

    async def _write(self, connection: _Connection) -> None:
        try:
            while True:
                await connection.call.write(await connection.commands.get())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            log.debug("Multiplex write ended: %s", error)

    async def _read(self, connection: _Connection) -> None:
        failure: ServiceError = Unavailable("inference ended the multiplexed stream")
        try:
            async for response in connection.call:
                self.last_response_s = time.monotonic()
                for output in response.outputs:
                    tokens = connection.requests.get(output.request_id)
                    if tokens is not None:
                        tokens.push(output)
                        if output.error_status or output.output.finish_reason:  # its last output
                            del connection.requests[output.request_id]
        except grpc.aio.AioRpcError as error:
            failure = error_from_rpc("inference", error)
            if error.code() != grpc.StatusCode.CANCELLED:
                log.warning("Multiplex stream to inference failed: %s: %s", error.code().name, error.details())
        finally:
            connection.is_broken = True
            connection.writer.cancel()
            for tokens in list(connection.requests.values()):
                tokens.fail(connection.failure or failure)
            connection.requests.clear()

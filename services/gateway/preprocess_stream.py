"""PreprocessStreamClient: every Preprocess of this gateway process to one preprocess server, on
one PreprocessStream call.

    PreprocessClient.preprocess ─▶ command queue ─writer task─▶ PreprocessStream call ─▶ preprocess
    its future ◀── reader task ◀── PreprocessStreamResponse (one per request, by request_id)

Why a stream, not a unary call per request: a message on an open stream costs about a third of
a unary call's round trip (170 against 450-550 µs on loopback), on every request's way to its
first token. The call opens on first use and lives as long as the gateway; if it breaks, each
request waiting on it fails UNAVAILABLE whatever status the call ended with (none of them was
answered, and preprocess is stateless, so the pool sends each to another server) and the next
request opens a new call. A server that does
not know the RPC (UNIMPLEMENTED: an older preprocess) is `is_unsupported`: the client then goes
back to unary calls for good.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Mapping

import grpc
from google.rpc import status_pb2

from llmserve.bidi_stream import write_queued
from llmserve.errors import DeadlineExceeded, ServiceError, Unavailable
from llmserve.gateway.hop_errors import error_from_broken_stream, error_from_status
from llmserve.request_context import context_without_request
from llmserve.v1 import preprocess_pb2, preprocess_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One PreprocessStream call, the requests waiting on it and the tasks that write and read it."""

    call: grpc.aio.StreamStreamCall
    commands: asyncio.Queue = field(default_factory=asyncio.Queue)
    waiting: dict[str, asyncio.Future] = field(default_factory=dict)
    is_broken: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)


class PreprocessStreamClient:
    def __init__(self, stub: preprocess_pb2_grpc.PreprocessServiceStub, client_fields: Mapping[str, str]):
        self._stub = stub
        self._client_fields = client_fields  # preprocess's field names as the gateway's clients know them
        self._call: _Call | None = None
        self.is_unsupported = False  # the server answered UNIMPLEMENTED: use unary calls

    async def preprocess(
        self, request: preprocess_pb2.PreprocessRequest, timeout_s: float | None
    ) -> preprocess_pb2.PreprocessResponse:
        """The request's response, or the ServiceError preprocess refused it with; at most
        `timeout_s` (None: no limit), which the server is told too."""
        call = self._open()
        answer = asyncio.get_running_loop().create_future()
        call.waiting[request.request_id] = answer
        timeout_ms = 0 if timeout_s is None else max(1, int(timeout_s * 1000))
        call.commands.put_nowait(preprocess_pb2.PreprocessStreamRequest(request=request, timeout_ms=timeout_ms))
        try:
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:
            raise DeadlineExceeded("preprocess did not answer before the deadline") from None
        finally:
            if call.waiting.get(request.request_id) is answer:
                del call.waiting[request.request_id]

    async def close(self) -> None:
        if self._call is not None:
            self._call.call.cancel()
            for task in self._call.tasks:
                task.cancel()
            self._call = None

    def _open(self) -> _Call:
        if self._call is None or self._call.is_broken:
            call = _Call(call=self._stub.PreprocessStream())
            loop = asyncio.get_running_loop()
            # Opened by whichever request came first, the call serves them all: its lines must
            # not carry that first request's id.
            for work in (write_queued(call.call, call.commands, "PreprocessStream"), self._read(call)):
                call.tasks.append(loop.create_task(work, context=context_without_request()))
            self._call = call
        return self._call

    async def _read(self, call: _Call) -> None:
        failure: ServiceError = Unavailable("preprocess ended the stream")
        try:
            async for message in call.call:
                answer = call.waiting.pop(message.request_id, None)
                if answer is None or answer.done():
                    continue  # its caller gave up (cancelled, or past its deadline)
                if message.HasField("response"):
                    answer.set_result(message.response)
                else:
                    status = status_pb2.Status.FromString(message.error_status)
                    answer.set_exception(error_from_status("preprocess", status, self._client_fields))
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.is_unsupported = True
            failure = error_from_broken_stream("preprocess", error, self._client_fields)
            if error.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNIMPLEMENTED):
                log.warning("PreprocessStream failed: %s: %s", error.code().name, error.details())
        finally:
            call.is_broken = True
            call.tasks[0].cancel()  # the writer
            for answer in call.waiting.values():
                if not answer.done():
                    answer.set_exception(failure)
            call.waiting.clear()

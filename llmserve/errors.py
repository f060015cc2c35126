"""Errors that cross service boundaries, and the one interceptor that maps them to gRPC status.

Servicers raise these (or let them propagate from validation); `ErrorMappingInterceptor` turns
them into a precise status code with the message, so no handler repeats try/except blocks.
Anything unexpected becomes INTERNAL with the request id logged, and the server stays up.

Besides the human message, every status carries a `google.rpc.Status` in the trailing metadata
(the gRPC ecosystem's rich error model, read with `grpc_status.rpc_status.from_call`): a
`BadRequest` field violation for INVALID_ARGUMENT and a `RetryInfo` where a retry makes sense.
Callers (our gateway included) read the field and the retry delay from there, never from prose.

Whatever an error says, what is sent is bounded (`rich_status_for`, `abort_with`): a message
may quote a client's value (quoted short at the source: llmserve.client_text), and this is the
last guard if one does not.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmserve.client_text import shortened
from llmserve.undecodable import Oversized, Undecodable, guard_deserializer

log = logging.getLogger(__name__)

# The message travels twice in the trailing metadata: percent-encoded in grpc-message (up to 3
# bytes a byte) and inside the google.rpc.Status in grpc-status-details-bin (base64: 4 per 3).
# grpc drops trailers over its 16 KiB metadata limit and the client then gets RESOURCE_EXHAUSTED
# "Stream removed" instead of the status (a 9,000-character model name quoted twice did). With
# these caps the two headers stay under ~9 KiB whatever an error says.
MAX_STATUS_MESSAGE_BYTES = 1024
MAX_STATUS_FIELD_BYTES = 256  # a BadRequest violation's field: a name with an index
MAX_RICH_STATUS_BYTES = 4096  # details past it are left out (none of ours come near it)

# google.rpc.ErrorInfo's fields: (reason, domain, metadata), e.g. a deadline refusal's estimate.
ErrorInfo = tuple[str, str, dict[str, str]]


class ServiceError(Exception):
    """An error with a gRPC status code and a message meant for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after_ms: int | None = None, error_info: ErrorInfo | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms  # sent as RetryInfo when set
        self.error_info = error_info  # sent as ErrorInfo when set


class InvalidArgument(ServiceError):
    """User input is wrong; `field` names it and `problem` says why (with the limit, where one
    applies). The message is "field: problem"; the field travels as a BadRequest violation."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Cancelled(ServiceError):
    """The request was cancelled before it started (aborted while it waited for something)."""

    code = grpc.StatusCode.CANCELLED


class FailedPrecondition(ServiceError):
    """The server is not set up for this (e.g. PinKvBlocks on a replica without --kv-pull)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    """The server is at a capacity limit for now (an admission budget, the prompt bytes in
    flight) or the request is over a size limit; `retry_after_ms`, when a retry can help, says
    when to try again (admission derives it from how fast the replica drains its queue)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


# A draining server or a restarting hop is back, or replaced, within about this long.
UNAVAILABLE_RETRY_AFTER_MS = 1000


class Unavailable(ServiceError):
    """The service is draining or a dependency is down; worth retrying after the hint."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, *, retry_after_ms: int | None = UNAVAILABLE_RETRY_AFTER_MS):
        super().__init__(message, retry_after_ms=retry_after_ms)


class DeadlineExceeded(ServiceError):
    """The request's deadline has passed, or cannot be met (then refused before any work is
    done)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


def _packed(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rich_status_for(error: ServiceError) -> status_pb2.Status:
    """The google.rpc.Status of `error`: code, message and its structured details."""
    status = status_pb2.Status(code=error.code.value[0], message=shortened(error.message, MAX_STATUS_MESSAGE_BYTES))
    if isinstance(error, InvalidArgument):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=shortened(error.field, MAX_STATUS_FIELD_BYTES),
            description=shortened(error.problem, MAX_STATUS_MESSAGE_BYTES),
        )
        status.details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if error.retry_after_ms is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        status.details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
    if error.error_info is not None:
        reason, domain, metadata = error.error_info
        status.details.append(_packed(error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata)))
    return status


async def abort_with(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    """Abort the RPC with the error's status and details; never returns (grpc raises)."""
    status = rpc_status.to_status(_within_metadata_limit(rich_status_for(error)))
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)


def _within_metadata_limit(status: status_pb2.Status) -> status_pb2.Status:
    """`status` with the details, in order, that fit MAX_RICH_STATUS_BYTES (the message is
    already capped)."""
    if status.ByteSize() <= MAX_RICH_STATUS_BYTES:
        return status
    bounded = status_pb2.Status(code=status.code, message=status.message)
    for detail in status.details:
        if bounded.ByteSize() + detail.ByteSize() + 8 > MAX_RICH_STATUS_BYTES:  # + the field's tag and length
            log.warning("status details over %d bytes left out: %s", MAX_RICH_STATUS_BYTES, detail.type_url)
            continue
        bounded.details.append(detail)
    return bounded


async def _map_exception(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, ServiceError):
        await abort_with(context, exc)
    log.exception("unhandled error in %s", method, exc_info=exc)
    # The exception may hold any value it met, a client's too: capped as any status.
    await abort_with(context, ServiceError(f"internal error in {method}: {type(exc).__name__}: {exc}"))


def check_decoded(request) -> None:
    """Raise the status of a request the guarded deserializer could not or would not parse."""
    if isinstance(request, Undecodable):
        raise InvalidArgument("request", request.problem)
    if isinstance(request, Oversized):  # no RetryInfo: the same request will never fit
        raise ResourceExhausted(f"request: {request.problem}")


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str):
    async def handler(request, context):
        try:
            check_decoded(request)
            return await behavior(request, context)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:  # noqa: BLE001 — the boundary that maps every error
            await _map_exception(exc, context, method)

    return handler


def _wrap_stream(behavior: Callable[..., Any], method: str):
    async def handler(request, context):
        try:
            check_decoded(request)
            async for response in behavior(request, context):
                yield response
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _map_exception(exc, context, method)

    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps ServiceError subclasses to their status, undecodable requests to INVALID_ARGUMENT,
    requests over `max_request_bytes` to RESOURCE_EXHAUSTED (unparsed) and anything else to
    INTERNAL."""

    def __init__(self, *, max_request_bytes: int):
        self._max_request_bytes = max_request_bytes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=guard_deserializer(handler.request_deserializer, method, self._max_request_bytes),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=guard_deserializer(handler.request_deserializer, method, self._max_request_bytes),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                # the request is an iterator here: the handler checks each message it reads
                _wrap_stream(handler.stream_stream, method),
                request_deserializer=guard_deserializer(handler.request_deserializer, method, self._max_request_bytes),
                response_serializer=handler.response_serializer,
            )
        return handler

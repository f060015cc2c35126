"""A hop's error status as the gateway's client sees it.

The hop's `google.rpc.Status` details (llmserve.errors) are read, not its message text: a
BadRequest field violation becomes an InvalidArgument naming the client's field (a hop may know
the field under another name), a RetryInfo keeps its delay and an ErrorInfo passes through; the
message is rebuilt from them.
"""

from __future__ import annotations

from typing import Mapping

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmserve.errors import UNAVAILABLE_RETRY_AFTER_MS, ErrorInfo, InvalidArgument, ServiceError, Unavailable

# Status codes that describe the request itself (bad input, full server, unknown model...): the
# client gets them as the hop sent them, message included.
_PASS_THROUGH_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


class DownstreamError(ServiceError):
    """An error status from preprocess or inference, forwarded with its code."""

    def __init__(
        self, code: grpc.StatusCode, message: str, *, retry_after_ms: int | None = None,
        error_info: ErrorInfo | None = None,
    ):  # fmt: skip
        super().__init__(message, retry_after_ms=retry_after_ms, error_info=error_info)
        self.code = code


def _rich_status(error: grpc.aio.AioRpcError) -> status_pb2.Status:
    try:
        return rpc_status.from_call(error) or status_pb2.Status()
    except ValueError:  # details that contradict the status: trust the status alone
        return status_pb2.Status()


def _detail(status: status_pb2.Status, message_type):
    for packed in status.details:
        if packed.Is(message_type.DESCRIPTOR):
            detail = message_type()
            packed.Unpack(detail)
            return detail
    return None


def _retry_after_ms(status: status_pb2.Status) -> int | None:
    retry_info = _detail(status, error_details_pb2.RetryInfo)
    return retry_info.retry_delay.ToMilliseconds() if retry_info is not None else None


def _error_info(status: status_pb2.Status) -> ErrorInfo | None:
    info = _detail(status, error_details_pb2.ErrorInfo)
    return (info.reason, info.domain, dict(info.metadata)) if info is not None else None


def _invalid_argument(status: status_pb2.Status, client_fields: Mapping[str, str]) -> InvalidArgument | None:
    bad_request = _detail(status, error_details_pb2.BadRequest)
    if bad_request is None or not bad_request.field_violations:
        return None
    violation = bad_request.field_violations[0]
    return InvalidArgument(client_fields.get(violation.field, violation.field), violation.description)


def error_from_rpc(
    service: str, error: grpc.aio.AioRpcError, client_fields: Mapping[str, str] | None = None
) -> ServiceError:
    """Map a hop's status to the one the gateway's client sees. `client_fields` renames the
    hop's field names to the client's (e.g. preprocess's max_tokens → sampling.max_tokens)."""
    return _client_error(service, error.code(), error.details() or "", _rich_status(error), client_fields or {})


async def call_hop(service: str, rpc, request, client_fields: Mapping[str, str] | None = None, **call_options):
    """`await rpc(request, **call_options)`: a unary call to a hop, its error as error_from_rpc maps it."""
    try:
        return await rpc(request, **call_options)
    except grpc.aio.AioRpcError as error:
        raise error_from_rpc(service, error, client_fields) from None


def error_from_broken_stream(
    service: str, error: grpc.aio.AioRpcError, client_fields: Mapping[str, str] | None = None
) -> ServiceError:
    """The error for each request left waiting on a multiplexed stream that ended with `error`.
    The call ended, not a request: none of them was answered, so they are UNAVAILABLE whatever
    code the call ended with (a killed server's connection surfaces as UNAVAILABLE or as INTERNAL
    "Internal error from Core", depending on when the reset lands), and a caller that may resend
    (a stateless hop, a request with no output yet) does. Only UNIMPLEMENTED (an older server
    without the RPC), CANCELLED (we closed it) and UNAVAILABLE (with the server's retry hint, if
    it sent one) map as error_from_rpc maps them."""
    if error.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
        return error_from_rpc(service, error, client_fields)
    return Unavailable(
        f"{service} stream broke: {error.code().name}: {error.details()}", retry_after_ms=UNAVAILABLE_RETRY_AFTER_MS
    )


def error_from_status(
    service: str, status: status_pb2.Status, client_fields: Mapping[str, str] | None = None
) -> ServiceError:
    """Map a status a hop sent as data (a refused request on a Multiplex or PreprocessStream
    stream), as above."""
    code = _STATUS_CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return _client_error(service, code, status.message, status, client_fields or {})


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _client_error(
    service: str, code: grpc.StatusCode, details: str, status: status_pb2.Status, client_fields: Mapping[str, str]
) -> ServiceError:
    retry_after_ms = _retry_after_ms(status)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        invalid = _invalid_argument(status, client_fields)
        if invalid is not None:
            return invalid
    if code == grpc.StatusCode.UNAVAILABLE:
        # A dead connection sends no hint: the client still gets the default one.
        retry_after_ms = retry_after_ms if retry_after_ms is not None else UNAVAILABLE_RETRY_AFTER_MS
        return Unavailable(f"{service} unavailable: {details}", retry_after_ms=retry_after_ms)
    if code in _PASS_THROUGH_CODES:
        return DownstreamError(code, details, retry_after_ms=retry_after_ms, error_info=_error_info(status))
    return ServiceError(f"{service} failed: {code.name}: {details}")

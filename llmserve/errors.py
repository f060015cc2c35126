"""Errors that cross service boundaries, and the one interceptor that maps them to gRPC status.

Servicers raise these (or let them propagate from validation); `ErrorMappingInterceptor` turns
them into a precise status code with the message, so no handler repeats try/except blocks.
Anything unexpected becomes INTERNAL with the request id logged, and the server stays up.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import grpc

log = logging.getLogger(__name__)

# Trailing-metadata key carrying a retry hint (milliseconds) on RESOURCE_EXHAUSTED/UNAVAILABLE.
RETRY_AFTER_MS_KEY = "retry-after-ms"


class ServiceError(Exception):
    """An error with a gRPC status code and a message meant for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after_ms: int | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms


class InvalidArgument(ServiceError):
    """User input is wrong; the message names the field and, where one applies, the limit."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class ResourceExhausted(ServiceError):
    """The server is full right now; retry after the hint."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Unavailable(ServiceError):
    """The service is draining or a dependency is down."""

    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


def trailing_metadata_for(error: ServiceError) -> tuple[tuple[str, str], ...]:
    if error.retry_after_ms is None:
        return ()
    return ((RETRY_AFTER_MS_KEY, str(error.retry_after_ms)),)


async def abort_with(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    """Abort the RPC with the error's status; never returns (grpc raises)."""
    metadata = trailing_metadata_for(error)
    if metadata:
        context.set_trailing_metadata(metadata)
    await context.abort(error.code, error.message)


async def _map_exception(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, ServiceError):
        await abort_with(context, exc)
    log.exception("unhandled error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str):
    async def handler(request, context):
        try:
            return await behavior(request, context)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:  # noqa: BLE001 — the boundary that maps every error
            await _map_exception(exc, context, method)

    return handler


def _wrap_stream(behavior: Callable[..., Any], method: str):
    async def handler(request, context):
        try:
            async for response in behavior(request, context):
                yield response
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _map_exception(exc, context, method)

    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps ServiceError subclasses to their status and anything else to INTERNAL."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

"""Reading the structured details of an error status, as any gRPC client would."""

from __future__ import annotations

from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


def _detail(error, message_type):
    """`error`: a failed call, or a google.rpc.Status sent as data (a Multiplex refusal)."""
    status = error if isinstance(error, status_pb2.Status) else rpc_status.from_call(error)
    assert status is not None, f"no google.rpc.Status in the trailing metadata of {error.details()!r}"
    for packed in status.details:
        if packed.Is(message_type.DESCRIPTOR):
            detail = message_type()
            packed.Unpack(detail)
            return detail
    raise AssertionError(f"no {message_type.DESCRIPTOR.name} in the details of {status.message!r}")


def field_violation(error) -> tuple[str, str]:
    """(field, description) of the one BadRequest field violation of an INVALID_ARGUMENT error."""
    [violation] = _detail(error, error_details_pb2.BadRequest).field_violations
    return violation.field, violation.description


def retry_delay_ms(error) -> int:
    """The RetryInfo delay of an error, in milliseconds."""
    return _detail(error, error_details_pb2.RetryInfo).retry_delay.ToMilliseconds()

"""Reading the structured details of an error status, as any gRPC client would (and, where a
status has none, its message: is_refused_at_admission)."""

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


# What admission's DeadlineExceeded says (services/inference/admission.py): the request was
# refused before it ran, because its deadline had passed or could not be met.
_ADMISSION_REFUSALS = ("cannot finish in", "before admission")


def is_refused_at_admission(details: str) -> bool:
    """Whether a DEADLINE_EXCEEDED error's details say the replica refused it at admission
    (nothing ran, so nothing is aborted), not that its deadline ran out while it ran.

    Read from the message: such a refusal carries no structured detail (no BadRequest, and no
    RetryInfo: the same request cannot be retried into its deadline), and a status from the
    server does not tell it apart either, since the gateway also sends one for a request the
    engine aborted at its deadline. This is the one place the tests read those words."""
    return any(words in details for words in _ADMISSION_REFUSALS)

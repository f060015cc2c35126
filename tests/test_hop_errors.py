"""How a hop's errors reach the gateway's callers: a multiplexed stream that breaks fails the
requests waiting on it UNAVAILABLE (so they may be sent elsewhere), whatever code it ended with."""

import grpc
import pytest

from llmserve.errors import Unavailable
from llmserve.gateway.hop_errors import error_from_broken_stream


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("code", [
    grpc.StatusCode.INTERNAL,  # what a killed server's reset can surface as
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
])
def test_a_broken_stream_fails_its_waiting_requests_unavailable_with_a_retry_hint(code):
    error = error_from_broken_stream("preprocess", _rpc_error(code, "Internal error from Core"))
    assert isinstance(error, Unavailable)
    assert error.retry_after_ms > 0
    assert "preprocess" in str(error)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED])
def test_an_older_server_or_our_own_cancel_keeps_its_code(code):
    error = error_from_broken_stream("inference", _rpc_error(code, "gone"))
    assert not isinstance(error, Unavailable)
    assert getattr(error, "code", None) == code or code.name in str(error)

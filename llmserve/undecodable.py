"""Requests that do not parse (invalid UTF-8 in a string field, truncated bytes) answer
INVALID_ARGUMENT naming the message, instead of grpc's UNKNOWN with a traceback per request.

grpc calls a method's request deserializer before any handler or interceptor code runs, and
maps an exception there to UNKNOWN. So the deserializer is wrapped: on DecodeError it returns an
`Undecodable` placeholder, and the handler wrapper (errors.ErrorMappingInterceptor) answers
INVALID_ARGUMENT (field `request`, the parser's words naming the message) when it receives one. A flood of bad messages logs one line per
method at most every `LOG_INTERVAL_S`, with the count it stood for.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Stands in for a request whose bytes did not parse."""

    method: str
    reason: str

    @property
    def problem(self) -> str:
        return f"not a valid protobuf message for {self.method}: {self.reason}"


class _RateLimitedLog:
    def __init__(self, interval_s: float):
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last_s: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, method: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_s.get(method, -self._interval_s) < self._interval_s:
                self._suppressed[method] = self._suppressed.get(method, 0) + 1
                return
            self._last_s[method] = now
            suppressed = self._suppressed.pop(method, 0)
        more = f" (and {suppressed} more since the last such line)" if suppressed else ""
        log.warning("rejected an undecodable request to %s: %s%s", method, reason, more)


_log = _RateLimitedLog(LOG_INTERVAL_S)


def guard_deserializer(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    """`deserializer`, returning an Undecodable instead of raising DecodeError."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as exc:
            reason = str(exc) or type(exc).__name__
            _log.warn(method, reason)
            return Undecodable(method, reason)

    return deserialize

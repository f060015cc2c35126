"""How many log lines of one kind a service writes: at most a few per window, then a count.

A client decides how often some lines are written (a refused request logs why), so a flood
of bad requests would otherwise become a flood of lines. `LogRateLimit`, installed on every
service's handler (llmserve.server.configure_logging), lets through at most
`max_lines_per_window` records of each kind per `window_s`, a kind being the logger and the
message template (`"rejected: %s"`, whatever its arguments); the first line of the kind let
through after some were dropped carries `num_suppressed_lines`, how many it stands for. DEBUG
records are not limited: whoever turns DEBUG on asked for a line per request.

`RateLimit` is the counting, with the clock passed in (tests use a fake one).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable

WINDOW_S = 10.0
MAX_LINES_PER_WINDOW = 20
# Kinds tracked at once: a logger given a message built per call (an f-string) makes a kind per
# call, and the table must not grow with them; nor must a key grow with such a message, so a
# kind is named by the template's first KIND_TEMPLATE_CHARS characters.
MAX_KINDS = 1024
KIND_TEMPLATE_CHARS = 200


@dataclass(slots=True)
class _Window:
    start_s: float
    num_admitted: int = 0
    num_refused: int = 0  # since the kind's last admitted event


class RateLimit:
    """At most `max_events` per `window_s` for each key; counts what it refuses."""

    def __init__(self, max_events: int, window_s: float, *, clock: Callable[[], float] = time.monotonic):
        self._max_events = max_events
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()  # services log from tokenizer and engine threads too
        self._windows: dict[Hashable, _Window] = {}

    def admit(self, key: Hashable) -> int | None:
        """None if the event is over the limit (refused); else the number of events of `key`
        refused since its last admitted one."""
        now_s = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None or now_s - window.start_s >= self._window_s:
                window = self._new_window(key, now_s, window)
            if window.num_admitted >= self._max_events:
                window.num_refused += 1
                return None
            window.num_admitted += 1
            num_refused, window.num_refused = window.num_refused, 0
            return num_refused

    def _new_window(self, key: Hashable, now_s: float, old: _Window | None) -> _Window:
        if old is None and len(self._windows) >= MAX_KINDS:
            self._forget_ended(now_s)
        window = _Window(start_s=now_s, num_refused=old.num_refused if old is not None else 0)
        self._windows[key] = window
        return window

    def _forget_ended(self, now_s: float) -> None:
        """Drop the windows that ended (their refused counts with them); all of them if every one
        is still open, which takes more than MAX_KINDS kinds in one window."""
        ended = [key for key, window in self._windows.items() if now_s - window.start_s >= self._window_s]
        for key in ended or list(self._windows):
            del self._windows[key]


class LogRateLimit(logging.Filter):
    """A handler filter: records of INFO and above, at most `max_lines_per_window` per kind
    (logger name, message template) per `window_s`."""

    def __init__(
        self, max_lines_per_window: int = MAX_LINES_PER_WINDOW, window_s: float = WINDOW_S,
        *, clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        super().__init__()
        self._limit = RateLimit(max_lines_per_window, window_s, clock=clock)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return True
        num_suppressed = self._limit.admit((record.name, str(record.msg)[:KIND_TEMPLATE_CHARS]))
        if num_suppressed is None:
            return False
        if num_suppressed:
            record.num_suppressed_lines = num_suppressed
        return True

"""Stop strings over a text stream: find a match across delta boundaries, never emit its text.

Text arrives in deltas that can cut a stop string anywhere ("...<|en" + "d|>"). The matcher
holds back the longest suffix of the text that could still grow into a stop string, so the
caller never emits a character it would later have to take back. The match reported is the
first point in the text at which some stop string is complete (ties: the longer string), which
does not depend on how the text was cut into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class StopCheck:
    """What one delta produced: text safe to emit now, and the stop string if one matched."""

    text: str
    matched_stop: str | None = None


class StopStringMatcher:
    """Per-request state of stop-string detection."""

    __slots__ = ("_stops", "_max_held_chars", "_held")

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._max_held_chars = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""

    @property
    def held_text(self) -> str:
        """Text received but not emitted yet because it may start a stop string."""
        return self._held

    def push(self, text: str) -> StopCheck:
        """Add a delta. After a match, the caller stops: later pushes are not meaningful."""
        if not self._stops:
            return StopCheck(text)
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            return StopCheck(buffer[:start], matched_stop=stop)
        num_held_chars = self._num_chars_to_hold(buffer)
        self._held = buffer[len(buffer) - num_held_chars :]
        return StopCheck(buffer[: len(buffer) - num_held_chars])

    def flush(self) -> str:
        """The stream ended without a match: the held text is ordinary output after all."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first; the longer one on a tie."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), -len(stop), stop)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _num_chars_to_hold(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        for num_chars in range(min(len(buffer), self._max_held_chars), 0, -1):
            suffix = buffer[-num_chars:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return num_chars
        return 0

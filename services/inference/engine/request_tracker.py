"""The torch engine's requests: which are unfinished (a request ends when its last sequence
does) and the totals EngineLoad reports. Pure Python."""

from __future__ import annotations


class RequestTracker:
    def __init__(self) -> None:
        self._num_unfinished_seqs: dict[str, int] = {}  # request id -> sequences not finished
        self.num_aborted_total = 0
        self.num_finished_total = 0  # aborted ones included

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._num_unfinished_seqs

    @property
    def has_unfinished(self) -> bool:
        return bool(self._num_unfinished_seqs)

    def add(self, request_id: str, num_seqs: int) -> None:
        if request_id in self._num_unfinished_seqs:
            raise ValueError(f"request {request_id!r} is already in flight")
        self._num_unfinished_seqs[request_id] = num_seqs

    def finish_seq(self, request_id: str) -> None:
        self._num_unfinished_seqs[request_id] -= 1
        if self._num_unfinished_seqs[request_id] == 0:
            self.finish_request(request_id)

    def finish_request(self, request_id: str) -> None:
        """Every sequence of the request ends now (its last one, a rejection or an abort)."""
        self._num_unfinished_seqs.pop(request_id, None)
        self.num_finished_total += 1

    def abort(self, request_id: str) -> None:
        self.finish_request(request_id)
        self.num_aborted_total += 1

"""EngineOutput: tokens of one sequence since its previous output, as every hop after the engine
reads them (the engine's step, the inference server, the gateway), and `coalesced`, the one way
outputs that queued up behind a slow reader are merged.

Why one type on both sides of the Multiplex stream: each conversion of a token is work per
token, and the gateway needs exactly what the engine said (tokens, logprobs, how it ended, the
usage and timings of the last one). Protobuf carries it between the processes (llmserve.pb).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.sampling import FinishReason, TokenLogprob


@dataclass(slots=True)
class EngineOutput:
    """Tokens produced for one sequence of a request since its previous output.

    The last output of a sequence has `finish_reason` set, and carries the usage and timing
    fields; earlier ones leave them at zero.
    """

    request_id: str
    sequence_index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    error_message: str = ""
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    num_pulled_tokens: int = 0  # of num_cached_tokens, pulled from another replica (KV pull)
    queue_time_ns: int = 0
    time_to_first_token_ns: int = 0
    total_time_ns: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def for_token(
        cls, request_id: str, sequence_index: int, token_id: int, logprob: TokenLogprob | None,
        finish: tuple[FinishReason | None, int | None],
    ) -> "EngineOutput":
        """The output of one new token; `finish` = (finish_reason, stop_token_id) at it."""
        return cls(
            request_id=request_id,
            sequence_index=sequence_index,
            new_token_ids=[token_id],
            logprobs=[logprob] if logprob is not None else None,
            finish_reason=finish[0],
            stop_token_id=finish[1],
        )


def coalesced(outputs: list[EngineOutput]) -> list[EngineOutput]:
    """One output per sequence, in the order each first appears: its tokens and logprobs
    appended in order, the finish fields of its last output (only a sequence's last output can
    be final). Reuses the objects it is given."""
    by_sequence: dict[tuple[str, int], EngineOutput] = {}
    for output in outputs:
        key = (output.request_id, output.sequence_index)
        earlier = by_sequence.get(key)
        by_sequence[key] = output if earlier is None else _joined(earlier, output)
    return list(by_sequence.values())


def _joined(earlier: EngineOutput, later: EngineOutput) -> EngineOutput:
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    later.new_token_ids = earlier.new_token_ids + later.new_token_ids
    later.logprobs = logprobs
    return later

"""EngineOutput: tokens of one sequence since its previous output, as every hop after the engine
reads them (the engine's step, the inference server, the gateway), and `coalesced`, the one way
outputs that queued up behind a slow reader are merged.

Why one type on both sides of the Multiplex stream: each conversion of a token is work per
token, and the gateway needs exactly what the engine said (tokens, logprobs, how it ended, the
usage and timings of the last one). Protobuf carries it between the processes (llmserve.pb).

Inside the inference server an engine step's outputs travel as `StepOutputs` (issue 19): the
common output, one plain token of a running sequence, is a row of three columns (`TokenColumns`:
request ids, sequence indexes, token ids) rather than an object; only outputs that carry more
(a finish, logprobs, an error) are EngineOutputs. At 256 sequences building an EngineOutput per
token was ~1 µs each in the engine-core process, and pickling them another ~0.5; the columns
cost a list comprehension each and pickle as three flat lists. Whoever needs objects (a
consumer of one request) reads a StepOutputs as a sequence of EngineOutputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class TokenColumns:
    """One new token for each of several sequences, none of them finished by it and none with
    logprobs: row i is token `token_ids[i]` of sequence `sequence_indexes[i]` of `request_ids[i]`.
    Each sequence appears at most once (a step gives a sequence one token)."""

    request_ids: list[str] = field(default_factory=list)
    sequence_indexes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: "TokenColumns") -> None:
        self.request_ids += other.request_ids
        self.sequence_indexes += other.sequence_indexes
        self.token_ids += other.token_ids

    def outputs(self) -> list[EngineOutput]:
        """An EngineOutput per row, in row order."""
        return [
            EngineOutput(request_id, index, [token_id])
            for request_id, index, token_id in zip(self.request_ids, self.sequence_indexes, self.token_ids)
        ]

    def as_tuple(self) -> tuple[list[str], list[int], list[int]]:
        """What a pickle carries (three flat lists); `TokenColumns(*t)` reads it back."""
        return self.request_ids, self.sequence_indexes, self.token_ids


class StepOutputs(SequenceABC):
    """One engine step's outputs: `outputs` (EngineOutputs: finals, logprobs, errors), then
    `tokens` (TokenColumns: plain tokens). A sequence has at most one output per step, so putting
    the objects first reorders nothing that one sequence produced.

    Read as a sequence it is the EngineOutputs (`outputs`, then a new one per token row), built
    on first read: tests and single-request consumers iterate, the engine loop and the
    engine-core process's message use the two parts as they are."""

    __slots__ = ("outputs", "tokens", "_expanded")

    def __init__(self, outputs: list[EngineOutput] | None = None, tokens: TokenColumns | None = None):
        self.outputs = outputs if outputs is not None else []
        self.tokens = tokens if tokens is not None else TokenColumns()
        self._expanded: list[EngineOutput] | None = None

    @classmethod
    def of(cls, outputs: "StepOutputs | list[EngineOutput]") -> "StepOutputs":
        """`outputs` as a StepOutputs (an engine core that returns a plain list: all objects)."""
        return outputs if isinstance(outputs, StepOutputs) else cls(list(outputs))

    def __len__(self) -> int:
        return len(self.outputs) + len(self.tokens)

    def __bool__(self) -> bool:
        return bool(self.outputs) or bool(self.tokens.token_ids)

    def __getitem__(self, index):
        return self.expanded()[index]

    def __iter__(self) -> Iterator[EngineOutput]:
        return iter(self.expanded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (StepOutputs, list)):
            return self.expanded() == list(other)
        return NotImplemented

    __hash__ = None  # mutable, like a list

    def __add__(self, other) -> list[EngineOutput]:
        return self.expanded() + list(other)

    def __radd__(self, other) -> list[EngineOutput]:
        return list(other) + self.expanded()

    def __repr__(self) -> str:
        return f"StepOutputs({self.outputs!r}, {self.tokens!r})"

    def expanded(self) -> list[EngineOutput]:
        """Every output as an EngineOutput: `outputs`, then one per token row (built once)."""
        if self._expanded is None:
            self._expanded = self.outputs + self.tokens.outputs() if self.tokens.token_ids else list(self.outputs)
        return self._expanded

"""Internal request types shared by the services (never generated protobuf classes).

Servicers convert protobuf messages to these at the boundary (llmserve.pb); engine code sees
only these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context was reached
    CANCELLED = "cancelled"  # client cancel or Abort
    # The request's deadline passed and the replica aborted it at a step boundary. Inside the
    # replica only: its servicer ends such a request with DEADLINE_EXCEEDED, as any RPC whose
    # deadline passed, so no client ever sees it as a finish reason.
    DEADLINE = "deadline"
    ERROR = "error"  # the engine failed on this request


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """Structured output: the engine masks every token its grammar does not allow, so the output
    is JSON (llmserve.response_format validates it at the edge; engine/grammar.py decodes it).
    `json_schema` None: any JSON object (OpenAI's json_object); else the JSON Schema's text,
    which the output validates against."""

    json_schema: str | None = None
    name: str = ""  # the schema's name, as the client gave it (OpenAI's json_schema.name)

    @property
    def kind(self) -> str:
        return "json_object" if self.json_schema is None else "json_schema"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings with every default resolved. temperature == 0 means greedy.

    `max_tokens` is resolved once, by preprocess (it knows the prompt length and the context):
    None only in the gateway, between the client's request (max_tokens unset) and preprocess's
    answer. Every EngineRequest carries it set (the inference servicer refuses None).
    """

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    min_p: float = 0.0
    seed: int | None = None  # None = random
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None = none; k = chosen token plus k alternatives
    n: int = 1
    response_format: ResponseFormat | None = None  # None: free text

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = field(default=())

"""TokenChunk: tokens of one inference message as the gateway's pipeline reads them, whichever
way they came (a GenerateTokens call or a Multiplex stream)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.pb import finish_reason_from_pb, logprobs_from_pb
from llmserve.sampling import FinishReason, TokenLogprob
from llmserve.v1 import inference_pb2


@dataclass(slots=True)
class TokenChunk:
    """Tokens of one inference stream message; the last one has finish_reason and usage."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    error_message: str = ""
    num_cached_tokens: int = 0
    queue_time_ns: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


def chunk_from_pb(response: inference_pb2.GenerateTokensResponse) -> TokenChunk:
    return TokenChunk(
        token_ids=list(response.token_ids),
        logprobs=logprobs_from_pb(response.logprobs) if response.logprobs else None,
        finish_reason=finish_reason_from_pb(response.finish_reason),
        error_message=response.error_message,
        num_cached_tokens=response.usage.cached_tokens,
        queue_time_ns=response.timings.queue_time_ns,
    )


def joined_chunks(chunks: list[TokenChunk]) -> TokenChunk:
    """The chunks of one sequence as one: tokens and logprobs in order, how it ended from the
    last (only the last can be final)."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    has_logprobs = any(chunk.logprobs is not None for chunk in chunks)
    return TokenChunk(
        token_ids=[token for chunk in chunks for token in chunk.token_ids],
        logprobs=[lp for chunk in chunks for lp in chunk.logprobs or []] if has_logprobs else None,
        finish_reason=last.finish_reason,
        error_message=last.error_message,
        num_cached_tokens=last.num_cached_tokens,
        queue_time_ns=last.queue_time_ns,
    )

"""When a sequence stops: the rules every engine core applies, written once.

Checked after each new token, in this order:
  1. a stop token -> STOP (the token is part of the output and named in stop_token_id): one of
     the request's stop_token_ids, or EOS unless ignore_eos; never before min_tokens (the
     samplers mask stop tokens until then);
  2. max_tokens generated -> LENGTH;
  3. the sequence at its length limit (the context, or the whole KV pool if smaller) -> LENGTH;
  4. a structured output's grammar (engine/grammar.py) is done, nothing but the end can follow
     (the JSON object closed) -> STOP, without waiting for an EOS token (whatever ignore_eos
     says: the grammar allows nothing more); a token the grammar refuses -> ERROR (the sampler's
     mask makes it impossible: an invariant that ends one sequence, not the engine).
Stop strings are the gateway's (it sees text; the engine sees ids).
"""

from __future__ import annotations

from llmserve.sampling import FinishReason, SamplingParams


_NO_TOKENS: frozenset[int] = frozenset()


def stop_token_ids(sampling: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The token ids that end this request's sequences with STOP. Called per token on the step's
    hot path: the common request (no stop ids of its own) gets the EOS set itself, no new set."""
    if not sampling.stop_token_ids:
        return _NO_TOKENS if sampling.ignore_eos else eos_token_ids
    requested = frozenset(sampling.stop_token_ids)
    return requested if sampling.ignore_eos else requested | eos_token_ids


def finish_at_token(
    token_id: int, num_completion_tokens: int, num_tokens: int, sampling: SamplingParams,
    stop_ids: frozenset[int], max_seq_tokens: int,
) -> tuple[FinishReason | None, int | None]:
    """(finish_reason, stop_token_id) once a sequence holds `num_tokens` tokens, the last of them
    `token_id`, the `num_completion_tokens`-th generated. STOP wins over LENGTH when the last
    allowed token is also a stop token."""
    if num_completion_tokens >= sampling.min_tokens and token_id in stop_ids:
        return FinishReason.STOP, token_id
    if reaches_length_limit(num_completion_tokens, num_tokens, sampling, max_seq_tokens):
        return FinishReason.LENGTH, None
    return None, None


def reaches_length_limit(num_completion_tokens: int, num_tokens: int, sampling: SamplingParams, max_seq_tokens: int) -> bool:
    """The LENGTH rule: max_tokens generated, or the sequence at its length limit."""
    return num_completion_tokens >= sampling.max_tokens or num_tokens >= max_seq_tokens


def length_limit(num_prompt_tokens: int, sampling: SamplingParams, max_seq_tokens: int) -> int:
    """The LENGTH rule as a token count: a sequence of this prompt reaches it once it holds this
    many tokens (reaches_length_limit, computed once per sequence for the step's hot path)."""
    return min(num_prompt_tokens + sampling.max_tokens, max_seq_tokens)


def finish_by_grammar(grammar, token_id: int) -> FinishReason | None:
    """Rule 4, for a sequence that rules 1-3 left running: `grammar` (a GrammarMatcher)
    accepts the token, and says whether it is done."""
    if not grammar.accept(token_id):
        return FinishReason.ERROR
    return FinishReason.STOP if grammar.is_done else None

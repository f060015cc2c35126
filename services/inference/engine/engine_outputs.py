"""EngineOutputs of the torch engine, built from the scheduler's NewTokens: one per new token,
and for a sequence's last one the usage and timings. Pure Python."""

from __future__ import annotations

from llmserve.inference.engine.sequence import Sequence
from llmserve.inference.engine.step_output import NewToken
from llmserve.engine_output import EngineOutput
from llmserve.sampling import FinishReason, TokenLogprob


def token_output(token: NewToken, logprob: TokenLogprob | None, now_ns: int) -> EngineOutput:
    seq = token.seq
    output = EngineOutput(
        seq.request_id, seq.sequence_index, [token.token_id], None if logprob is None else [logprob],
        token.finish_reason, token.stop_token_id,
    )
    if token.finish_reason is not None:
        output.error_message = seq.error_message
        _fill_final(output, seq, now_ns)
    return output


def error_outputs(seq: Sequence, now_ns: int) -> list[EngineOutput]:
    """A rejected request ends every one of its n sequences with the error."""
    outputs = []
    for index in range(seq.sampling.n):
        output = EngineOutput(
            request_id=seq.request_id,
            sequence_index=index,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            error_message=seq.error_message,
        )
        _fill_final(output, seq, now_ns)
        outputs.append(output)
    return outputs


def _fill_final(output: EngineOutput, seq: Sequence, now_ns: int) -> None:
    output.num_prompt_tokens = seq.num_prompt_tokens
    output.num_completion_tokens = seq.num_completion_tokens
    output.num_cached_tokens = seq.num_cached_tokens
    if seq.first_scheduled_ns:
        output.queue_time_ns = max(0, seq.first_scheduled_ns - seq.arrival_ns)
    if seq.first_token_ns:
        output.time_to_first_token_ns = max(0, seq.first_token_ns - seq.arrival_ns)
    output.total_time_ns = max(0, now_ns - seq.arrival_ns)

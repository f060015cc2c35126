"""The torch engine's outputs of a step, built from the scheduler's SampledTokens: the plain
tokens as columns (llmserve.engine_output.TokenColumns), an EngineOutput for a token that
carries more (logprobs, or the finish with the sequence's usage and timings). Pure Python.

The common step (no sequence finishes, none asks for logprobs) takes three list
comprehensions, whatever the batch size; a step with a few special rows filters them out.
"""

from __future__ import annotations

from llmserve.inference.engine.sequence import Sequence
from llmserve.inference.engine.step_output import SampledTokens
from llmserve.engine_output import EngineOutput, StepOutputs, TokenColumns
from llmserve.sampling import FinishReason, TokenLogprob


def step_outputs(sampled: SampledTokens, logprobs: dict[int, TokenLogprob], now_ns: int) -> StepOutputs:
    """`logprobs`: by row of the launch's sampled tokens (SampledTokens.rows), for the rows that
    asked for them."""
    seqs, token_ids = sampled.seqs, sampled.token_ids
    if not sampled.finishes and not logprobs:
        return StepOutputs([], _columns(seqs, token_ids))
    finishes = {i: (reason, stop_token_id) for i, reason, stop_token_id in sampled.finishes}
    special = set(finishes)
    if logprobs:
        special.update(i for i, row in enumerate(sampled.rows) if row in logprobs)
    outputs = []
    for i in sorted(special):
        seq = seqs[i]
        logprob = logprobs.get(sampled.rows[i])
        reason, stop_token_id = finishes.get(i, (None, None))
        output = EngineOutput(
            seq.request_id, seq.sequence_index, [token_ids[i]], None if logprob is None else [logprob],
            reason, stop_token_id,
        )
        if reason is not None:
            output.error_message = seq.error_message
            _fill_final(output, seq, now_ns)
        outputs.append(output)
    plain = [i for i in range(len(seqs)) if i not in special]
    return StepOutputs(outputs, _columns([seqs[i] for i in plain], [token_ids[i] for i in plain]))


def _columns(seqs: list[Sequence], token_ids: list[int]) -> TokenColumns:
    return TokenColumns(
        [seq.request_id for seq in seqs], [seq.sequence_index for seq in seqs], list(token_ids)
    )


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

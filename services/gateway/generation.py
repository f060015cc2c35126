"""One generation request through the gateway, as a stream of text deltas.

Lifecycle (the servicer turns each step's output into protobuf):
  1. preprocess.Preprocess: template, tokenize, validate; it resolves max_tokens. A small prompt
     at light load is preprocessed in this process instead (local_preprocess.py).
  2. the router picks a live replica (router.py), counting the request in flight there;
     the request goes on the replica's Multiplex stream (max_tokens resolved, stop strings kept
     here); its outputs come back as EngineOutputs, everything since the last one merged
     (replica_stream.py: where a slow client is coalesced and bounded).
  3. each output → incremental detokenizer (whole characters only) → stop-string matcher
     (holds back text that may start a stop string) → a GenerationDelta.
  4. the last delta carries finish reason, usage, timings and the routing decision.
     A replica that refuses it at admission (RESOURCE_EXHAUSTED, before any token) passes it
     on: the router picks again among the live replicas that have not refused it, so the
     client is refused only when every replica is full.
  5. if the request ends before inference finished it (client cancel, deadline, stop string,
     error), the inference request is cancelled (an abort on the Multiplex stream), so its KV
     blocks are freed at once. A request whose deadline passed on the replica ends with the
     DEADLINE_EXCEEDED status the replica sent.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

import grpc

from llmserve.engine_output import EngineOutput
from llmserve.errors import ServiceError
from llmserve.gateway.detokenizer import NUM_PROMPT_CONTEXT_TOKENS, Detokenizer, DetokenizerStream
from llmserve.gateway.hop_errors import DownstreamError
from llmserve.gateway.local_preprocess import LocalPreprocess
from llmserve.gateway.metrics import (
    record_finished, record_first_tokens, record_next_tokens, record_preprocessed_in_gateway, record_reroute,
)
from llmserve.gateway.preprocess_client import PreparedPrompt
from llmserve.prompt_input import PromptInput
from llmserve.gateway.preprocess_pool import PreprocessPool
from llmserve.gateway.replica import Replica
from llmserve.gateway.router import RouteDecision, Router
from llmserve.gateway.stop_strings import StopStringMatcher
from llmserve.sampling import FinishReason, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

# Seconds left on the client's deadline, None when it set none (grpc's context.time_remaining).
TimeRemaining = Callable[[], float | None]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated client request; `sampling.max_tokens` is the client's (None: unset)."""

    request_id: str
    prompt_input: PromptInput
    sampling: SamplingParams
    arrival_ns: int
    cache_salt: str = field(repr=False)  # whom it shares the prefix cache with; never logged


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """How a request ended: on the last delta only."""

    finish_reason: FinishReason
    matched_stop: str | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    queue_time_ns: int
    preprocess_time_ns: int
    time_to_first_token_ns: int
    total_time_ns: int
    replica_id: str
    predicted_cached_tokens: int
    num_pulled_tokens: int = 0  # of num_cached_tokens, pulled from another replica (KV pull)
    pulled_from: str = ""  # the replica it was pulled from, when the router said to pull


@dataclass(slots=True)
class GenerationDelta:
    """Output of one inference message for one sequence: the text it completed and the tokens
    behind it."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    result: GenerationResult | None = None  # set on the sequence's last delta
    sequence_index: int = 0  # which of the request's sampling.n sequences


def sampling_for_inference(sampling: SamplingParams, max_tokens: int) -> SamplingParams:
    """The inference request's sampling: max_tokens as preprocess resolved it, stop strings left out.

    Stop strings are matched on text, which only the gateway has; inference stops on token ids.
    """
    return replace(sampling, max_tokens=max_tokens, stop=())


@dataclass(slots=True)
class _SequenceState:
    """One sequence's progress: its text so far is detokenized and checked for stop strings on
    its own (sampling.n sequences interleave on one stream)."""

    detokenizer: DetokenizerStream
    stop_matcher: StopStringMatcher
    num_completion_tokens: int = 0
    last_token_ns: int = 0  # when its latest output with tokens came
    result: GenerationResult | None = None  # set once it ended (later outputs are dropped)


@dataclass(slots=True)
class _RequestState:
    """Per-request progress while the inference stream is read."""

    prompt: PreparedPrompt
    route: RouteDecision
    sequences: list[_SequenceState]
    first_token_ns: int | None = None
    num_ended: int = 0  # sequences with a result
    num_finished_by_inference: int = 0  # sequences whose final output inference sent

    @property
    def is_done(self) -> bool:
        return self.num_ended == len(self.sequences)


class GenerationPipeline:
    """Runs requests through preprocess and inference; shared by all requests."""

    def __init__(
        self, preprocess: PreprocessPool, router: Router, detokenizer: Detokenizer, local: LocalPreprocess | None = None
    ):
        self._preprocess = preprocess
        self._router = router
        self._detokenizer = detokenizer
        self._local = local
        self._num_in_flight = 0  # requests in `generate` now (the local preprocess rule reads it)

    async def generate(
        self, request: GenerationRequest, time_remaining: TimeRemaining
    ) -> AsyncIterator[GenerationDelta]:
        """Yield a delta per inference message and sequence; each sequence's last one has
        `result` set, and the iteration ends after the last sequence's."""
        self._num_in_flight += 1
        try:
            prompt = await self._prepare(request, time_remaining)
            refused: list[Replica] = []
            while True:
                route = await self._router.choose(prompt, excluding=refused)
                has_output = False
                try:
                    async with aclosing(self._generate_routed(route, request, prompt, time_remaining)) as deltas:
                        async for delta in deltas:
                            has_output = True
                            yield delta
                    return
                except DownstreamError as error:
                    refused.append(route.replica)
                    if has_output or not _is_admission_refusal(error) or not self._router.has_replica_beyond(refused):
                        raise
                    record_reroute(route.replica.name)
                    log.info("replica %s refused request %s (%s); routing it again", route.replica.name,
                             request.request_id, error)
        finally:
            self._num_in_flight -= 1

    async def _prepare(self, request: GenerationRequest, time_remaining: TimeRemaining) -> PreparedPrompt:
        """The prompt preprocessed: here when it is small and the worker lightly loaded, else by the tier."""
        if self._local is not None and self._local.takes(request.prompt_input, self._num_in_flight):
            prompt = self._local.preprocess(
                request.prompt_input, max_tokens=request.sampling.max_tokens, cache_salt=request.cache_salt
            )
            record_preprocessed_in_gateway()
            return prompt
        return await self._preprocess.preprocess(
            request.request_id,
            request.prompt_input,
            max_tokens=request.sampling.max_tokens,
            cache_salt=request.cache_salt,
            timeout_s=time_remaining(),
        )

    async def _generate_routed(
        self, route: RouteDecision, request: GenerationRequest, prompt: PreparedPrompt, time_remaining: TimeRemaining
    ) -> AsyncIterator[GenerationDelta]:
        """The request on the route's replica, counted in flight there (its prefill queued until
        its first token). One generator for both: every layer of `async for ... yield` between
        the replica's buffer and the client's stream is paid per message."""
        # Read before the request goes out: for ids in preprocess's ring, an entry gone fails
        # here (UNAVAILABLE), with nothing started on the replica.
        prompt_context = prompt.last_token_ids(NUM_PROMPT_CONTEXT_TOKENS)
        with route.replica.dispatched(route.prefill_blocks) as dispatch:
            stream = route.replica.client.generate(
                request.request_id,
                prompt,
                sampling_for_inference(request.sampling, prompt.max_tokens),
                timeout_s=time_remaining(),
                kv_pull=(route.pull_from.address, route.pull_blocks) if route.pull_from is not None else None,
            )
            state = _RequestState(prompt=prompt, route=route, sequences=[
                _SequenceState(self._detokenizer.new_stream(prompt_context), StopStringMatcher(request.sampling.stop))
                for _ in range(request.sampling.n)
            ])
            try:
                async for output in stream:
                    if output.is_finished:
                        state.num_finished_by_inference += 1
                    if state.first_token_ns is None and output.new_token_ids:
                        dispatch.prefilled()
                    delta = self._on_output(request, state, output)
                    if delta is not None:
                        yield delta
                    if state.is_done:
                        _record_request(request.request_id, state)
                        return
                raise ServiceError(f"inference ended request {request.request_id} without a finish reason")
            finally:
                # Cancel, deadline, stop string or error: inference must not keep generating.
                if state.num_finished_by_inference < len(state.sequences):
                    stream.cancel()

    def _on_output(
        self, request: GenerationRequest, state: _RequestState, output: EngineOutput
    ) -> GenerationDelta | None:
        """The delta of one output of one sequence; None for one whose sequence already ended
        (a stop string matched while inference, which stops requests, not sequences, went on)."""
        sequence = state.sequences[output.sequence_index]
        if sequence.result is not None:
            return None
        now_ns = time.monotonic_ns()
        if output.new_token_ids:
            self._on_tokens(request, state, sequence, len(output.new_token_ids), now_ns)
        text = sequence.detokenizer.push(output.new_token_ids)
        if output.is_finished:
            text += sequence.detokenizer.flush()
        check = sequence.stop_matcher.push(text)
        delta = GenerationDelta(text=check.text, token_ids=output.new_token_ids, logprobs=output.logprobs,
                                sequence_index=output.sequence_index)
        if check.matched_stop is not None:
            delta.result = self._result(request, state, sequence, output, FinishReason.STOP, check.matched_stop, now_ns)
        elif output.is_finished:
            if output.finish_reason == FinishReason.ERROR:
                raise ServiceError(f"inference failed on request {request.request_id}: {output.error_message}")
            delta.text += sequence.stop_matcher.flush()
            delta.result = self._result(request, state, sequence, output, output.finish_reason, None, now_ns)
        if delta.result is not None:
            sequence.result = delta.result
            state.num_ended += 1
        return delta

    @staticmethod
    def _on_tokens(
        request: GenerationRequest, state: _RequestState, sequence: _SequenceState, num_tokens: int, now_ns: int
    ) -> None:
        if state.first_token_ns is None:
            state.first_token_ns = now_ns
            record_first_tokens(now_ns - request.arrival_ns, num_tokens)
        elif sequence.last_token_ns:
            record_next_tokens(now_ns - sequence.last_token_ns, num_tokens)
        else:  # another sequence's first tokens: counted from the request's first
            record_next_tokens(now_ns - state.first_token_ns, num_tokens)
        sequence.last_token_ns = now_ns
        sequence.num_completion_tokens += num_tokens

    @staticmethod
    def _result(
        request: GenerationRequest,
        state: _RequestState,
        sequence: _SequenceState,
        output: EngineOutput,
        finish_reason: FinishReason,
        matched_stop: str | None,
        now_ns: int,
    ) -> GenerationResult:
        # queue time and cached tokens come with inference's last message; a stop string ends
        # the request before that message, so they are 0 then.
        first_token_ns = state.first_token_ns if state.first_token_ns is not None else now_ns
        return GenerationResult(
            finish_reason=finish_reason,
            matched_stop=matched_stop,
            num_prompt_tokens=state.prompt.num_tokens,
            num_completion_tokens=sequence.num_completion_tokens,
            num_cached_tokens=output.num_cached_tokens,
            queue_time_ns=output.queue_time_ns,
            preprocess_time_ns=state.prompt.preprocess_time_ns,
            time_to_first_token_ns=first_token_ns - request.arrival_ns,
            total_time_ns=now_ns - request.arrival_ns,
            replica_id=state.route.replica.name,
            predicted_cached_tokens=state.route.predicted_cached_tokens,
            num_pulled_tokens=output.num_pulled_tokens,
            pulled_from=state.route.pull_from.name if state.route.pull_from is not None else "",
        )


def _is_admission_refusal(error: DownstreamError) -> bool:
    """A replica's admission turned the request away (full KV pool, queue or step budget): it
    ran nothing, and another replica may have room."""
    return error.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def _record_request(request_id: str, state: _RequestState) -> None:
    """Log and count a request once all its sequences ended: as its last sequence's result, with
    the completion tokens of all of them."""
    results = [sequence.result for sequence in state.sequences]
    last = max(results, key=lambda result: result.total_time_ns)
    summary = replace(last, num_completion_tokens=sum(result.num_completion_tokens for result in results))
    _log_finished(request_id, summary)
    record_finished(summary, is_reported_by_inference=state.num_finished_by_inference == len(state.sequences))


def _log_finished(request_id: str, result: GenerationResult) -> None:
    log.debug(
        "request %s finished (%s) on %s: %d prompt + %d completion tokens (%d cached, %d predicted); "
        "preprocess %.1f ms, queue %.1f ms, ttft %.1f ms, total %.1f ms",
        request_id, result.finish_reason.value,
        result.replica_id, result.num_prompt_tokens, result.num_completion_tokens, result.num_cached_tokens,
        result.predicted_cached_tokens,
        result.preprocess_time_ns / 1e6, result.queue_time_ns / 1e6,
        result.time_to_first_token_ns / 1e6, result.total_time_ns / 1e6,
        extra={"matched_stop": result.matched_stop},  # a text field (llmserve.log_format): completion text
    )

"""The Gateway gRPC service: protobuf in and out; the work happens in GenerationPipeline.

Every request gets a request id (uuid4 hex) sent back in the `x-request-id` initial metadata
and in the response, and bound to the RPC's context (llmserve.request_context), so that every
line logged while serving it carries it; `x-gateway-worker` names the worker process that
served it. Sampling
parameters are validated here, at the edge; errors from the hops come through as the statuses
`hop_errors.error_from_rpc` chose. Each request is counted by how it ended (gateway.metrics).
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from llmserve.block_hash import check_cache_salt
from llmserve.call_balancing import WORKER_METADATA_KEY
from llmserve.client_text import quoted
from llmserve.errors import InvalidArgument, NotFound
from llmserve.gateway.generation import GenerationDelta, GenerationPipeline, GenerationRequest, GenerationResult
from llmserve.gateway.inference_client import ModelCard
from llmserve.gateway.metrics import tracked_request
from llmserve.gateway.request_id import REQUEST_ID_METADATA_KEY, new_request_id
from llmserve.pb import finish_reason_to_pb, logprobs_to_pb, prompt_input_from_pb, sampling_from_pb
from llmserve.prompt_input import PromptInput
from llmserve.request_context import bind_request_id
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(
        self,
        pipeline: GenerationPipeline,
        model: ModelCard,
        model_name: str,
        *,
        worker_id: int = 0,
    ):
        self._pipeline = pipeline
        self._model = model
        self._model_name = model_name
        self._worker_metadata = (WORKER_METADATA_KEY, str(worker_id))

    # What the HTTP face (openai_http) shares with this one.
    @property
    def pipeline(self) -> GenerationPipeline:
        return self._pipeline

    @property
    def model(self) -> ModelCard:
        return self._model

    @property
    def model_name(self) -> str:
        return self._model_name

    async def GenerateStream(self, request: gateway_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext):
        """Each message carries every token of one sequence made since the last one was sent (the
        pipeline reads its replica's buffer only when the previous message is written:
        replica_stream.py); with sampling.n > 1 the sequences' messages interleave."""
        params = request.params
        with tracked_request(context) as outcome:
            generation = await self._start(params, context)
            async with aclosing(self._generate(generation, context)) as deltas:
                async for delta in deltas:
                    if delta.result is not None:
                        outcome.finish_reason = delta.result.finish_reason
                    if delta.result is not None or _has_content(delta, params.return_token_ids):
                        yield _stream_response_to_pb(generation.request_id, delta, params.return_token_ids)

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        params = request.params
        with tracked_request(context) as outcome:
            generation = await self._start(params, context)
            sequences = [gateway_pb2.GeneratedSequence(sequence_index=i) for i in range(generation.sampling.n)]
            text_parts: list[list[str]] = [[] for _ in sequences]
            async with aclosing(self._generate(generation, context)) as deltas:
                async for delta in deltas:
                    sequence = sequences[delta.sequence_index]
                    text_parts[delta.sequence_index].append(delta.text)
                    if params.return_token_ids:
                        sequence.token_ids.extend(delta.token_ids)
                    if delta.logprobs:
                        sequence.logprobs.extend(logprobs_to_pb(delta.logprobs))
                    if delta.result is not None:
                        outcome.finish_reason = delta.result.finish_reason
                        sequence.result.CopyFrom(_result_to_pb(delta.result))
        for sequence, parts in zip(sequences, text_parts):
            sequence.text = "".join(parts)
        first = sequences[0]
        response = gateway_pb2.GenerateResponse(
            request_id=generation.request_id, text=first.text, token_ids=first.token_ids, logprobs=first.logprobs,
            result=first.result,
        )
        if len(sequences) > 1:
            response.sequences.extend(sequences)
        return response

    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext):
        await context.send_initial_metadata((self._worker_metadata,))
        model = common_pb2.ModelInfo(
            model_name=self._model_name,
            architecture=self._model.architecture,
            max_context_tokens=self._model.max_context_tokens,
            eos_token_ids=self._model.eos_token_ids,
            backend=self._model.backend,
        )
        return gateway_pb2.ListModelsResponse(models=[model])

    async def _start(
        self, request: gateway_pb2.GenerateParams, context: grpc.aio.ServicerContext
    ) -> GenerationRequest:
        """Mint the request id, send it as metadata, validate the request."""
        arrival_ns = time.monotonic_ns()
        request_id = new_request_id()
        bind_request_id(request_id)
        await context.send_initial_metadata(((REQUEST_ID_METADATA_KEY, request_id), self._worker_metadata))
        generation = self.request_from_params(request, request_id, arrival_ns)
        log.debug("accepted", extra={"prompt": generation.prompt_input})
        return generation

    def _generate(
        self, generation: GenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[GenerationDelta]:
        deltas = self._pipeline.generate(generation, context.time_remaining)
        # Only at DEBUG: collecting the completion costs a little on every delta.
        return _logging_completion(deltas) if log.isEnabledFor(logging.DEBUG) else deltas

    def request_from_params(
        self, request: gateway_pb2.GenerateParams, request_id: str, arrival_ns: int
    ) -> GenerationRequest:
        """The validated request (InvalidArgument or NotFound naming what is wrong)."""
        if request.model and request.model != self._model_name:
            raise NotFound(f"model: unknown model {quoted(request.model)}; this gateway serves {self._model_name!r}")
        check_cache_salt(request.cache_salt)
        sampling = sampling_from_pb(request.sampling)
        if sampling.max_tokens is None:
            _check_min_tokens_fit(sampling.min_tokens, self._model.max_context_tokens)
        return GenerationRequest(
            request_id=request_id,
            prompt_input=_prompt_input_from_pb(request),
            sampling=sampling,
            arrival_ns=arrival_ns,
            cache_salt=request.cache_salt,
        )


def _check_min_tokens_fit(min_tokens: int, max_context_tokens: int) -> None:
    """With max_tokens unset, preprocess resolves it to what fits the context after the prompt
    (inference then checks min_tokens against that): no request can make more than the context
    less its one-token prompt, so a larger min_tokens is refused before any hop."""
    max_output_tokens = max_context_tokens - 1
    if min_tokens > max_output_tokens:
        raise InvalidArgument(
            "sampling.min_tokens",
            f"{min_tokens} exceeds the {max_output_tokens} tokens any request can generate in the model "
            f"context of {max_context_tokens} tokens",
        )


def _prompt_input_from_pb(request: gateway_pb2.GenerateParams) -> PromptInput:
    # Token ids are checked by preprocess, against the vocabulary of the tokenizer it and the
    # detokenizer share.
    prompt_input = prompt_input_from_pb(request)
    if prompt_input is None:
        raise InvalidArgument("input", "set one of prompt, chat or prompt_token_ids")
    return prompt_input


async def _logging_completion(deltas: AsyncIterator[GenerationDelta]) -> AsyncIterator[GenerationDelta]:
    """`deltas`, passed on; once they end, a DEBUG line with the completion (text fields: llmserve.log_format)."""
    texts: list[str] = []
    token_ids: list[int] = []
    async with aclosing(deltas):
        async for delta in deltas:
            texts.append(delta.text)
            token_ids.extend(delta.token_ids)
            yield delta
    log.debug(
        "completion sent: %d tokens", len(token_ids),
        extra={"completion": "".join(texts), "completion_token_ids": token_ids},
    )


def _has_content(delta: GenerationDelta, return_token_ids: bool) -> bool:
    return bool(delta.text) or bool(delta.logprobs) or (return_token_ids and bool(delta.token_ids))


def _usage_to_pb(result: GenerationResult) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=result.num_prompt_tokens,
        completion_tokens=result.num_completion_tokens,
        cached_tokens=result.num_cached_tokens,
        pulled_tokens=result.num_pulled_tokens,
    )


def _timings_to_pb(result: GenerationResult) -> common_pb2.Timings:
    return common_pb2.Timings(
        queue_time_ns=result.queue_time_ns,
        preprocess_time_ns=result.preprocess_time_ns,
        time_to_first_token_ns=result.time_to_first_token_ns,
        total_time_ns=result.total_time_ns,
    )


def _result_to_pb(result: GenerationResult) -> gateway_pb2.GenerationResult:
    return gateway_pb2.GenerationResult(
        finish_reason=finish_reason_to_pb(result.finish_reason),
        matched_stop=result.matched_stop,
        usage=_usage_to_pb(result),
        timings=_timings_to_pb(result),
        routing=gateway_pb2.RoutingInfo(
            replica_id=result.replica_id, predicted_cached_tokens=result.predicted_cached_tokens,
            pull_source_replica_id=result.pulled_from,
        ),
    )


def _stream_response_to_pb(
    request_id: str, delta: GenerationDelta, return_token_ids: bool
) -> gateway_pb2.GenerateStreamResponse:
    response = gateway_pb2.GenerateStreamResponse(request_id=request_id, text=delta.text, sequence_index=delta.sequence_index)
    if return_token_ids:
        response.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        response.logprobs.extend(logprobs_to_pb(delta.logprobs))
    if delta.result is not None:
        response.result.CopyFrom(_result_to_pb(delta.result))
    return response

"""The Inference gRPC servicer: validates at the edge, converts, streams engine outputs.

Protobuf stops here: requests become EngineRequest, EngineOutput becomes one
GenerateTokensResponse each (nothing is coalesced). Errors are raised as llmserve.errors types;
the interceptor installed by create_server maps them to status codes.

Cancellation: when the client cancels or the deadline passes, grpc.aio cancels the handler
(asyncio.CancelledError at its current await). That unwinds the engine's generate(), whose
`finally` aborts the request in the engine, freeing its KV blocks.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from llmserve import pb
from llmserve.errors import InvalidArgument
from llmserve.inference.backends import ServingEngine
from llmserve.inference.engine.types import EngineOutput, EngineRequest, ModelInfo
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """`replica_id` may be set once after binding (its default names the bound port)."""

    def __init__(self, engine: ServingEngine, replica_id: str):
        self._engine = engine
        self.replica_id = replica_id

    async def GenerateTokens(
        self, request: inference_pb2.GenerateTokensRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateTokensResponse]:
        arrival_ns = time.monotonic_ns()
        engine_request = request_from_pb(request, self._engine.model_info, arrival_ns)
        async with aclosing(self._engine.generate(engine_request)) as outputs:
            async for output in outputs:
                yield output_to_pb(output)

    async def Abort(
        self, request: inference_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.AbortResponse:
        return inference_pb2.AbortResponse(was_running=self._engine.abort(request.request_id))

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetModelInfoResponse:
        info = self._engine.model_info
        model = common_pb2.ModelInfo(
            model_name=info.model_name,
            architecture=info.architecture,
            max_context_tokens=info.max_context_tokens,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            block_size_tokens=info.block_size_tokens,
            dtype=info.dtype,
            backend=info.backend,
            device=info.device,
        )
        return inference_pb2.GetModelInfoResponse(model=model, replica_id=self.replica_id)

    async def GetLoad(
        self, request: inference_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetLoadResponse:
        load = self._engine.load()
        return inference_pb2.GetLoadResponse(
            replica_id=self.replica_id,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_used=load.kv_blocks_used,
            num_aborted_total=load.num_aborted_total,
            num_finished_total=load.num_finished_total,
            prefix_cache_queried_tokens_total=load.prefix_cache_queried_tokens_total,
            prefix_cache_hit_tokens_total=load.prefix_cache_hit_tokens_total,
            num_preemptions_total=load.num_preemptions_total,
        )


def request_from_pb(
    pb_request: inference_pb2.GenerateTokensRequest, info: ModelInfo, arrival_ns: int
) -> EngineRequest:
    """Validate a GenerateTokensRequest against the model and convert it.

    `arrival_ns` is time.monotonic_ns() (engines measure queue and first-token times from it).
    """
    if not pb_request.request_id:
        raise InvalidArgument("request_id", "must not be empty")
    prompt_token_ids = list(pb_request.prompt_token_ids)
    _check_prompt(prompt_token_ids, info)
    num_room_tokens = info.max_context_tokens - len(prompt_token_ids)
    sampling = pb.sampling_from_pb(pb_request.sampling, default_max_tokens=num_room_tokens)
    if sampling.max_tokens > num_room_tokens:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"{sampling.max_tokens} tokens do not fit: the prompt has {len(prompt_token_ids)} tokens "
            f"and the context is {info.max_context_tokens}, so at most {num_room_tokens}",
        )
    for i, token_id in enumerate(sampling.stop_token_ids):
        if token_id >= info.vocab_size:
            raise InvalidArgument(
                f"sampling.stop_token_ids[{i}]", f"token id {token_id} is not below the vocab size {info.vocab_size}"
            )
    _check_block_hashes(pb_request, len(prompt_token_ids))
    return EngineRequest(
        request_id=pb_request.request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        arrival_ns=arrival_ns,
        block_hashes=list(pb_request.block_hashes),
        block_size_tokens=pb_request.block_size_tokens,
        block_hash_version=pb_request.block_hash_version,
        priority=pb_request.priority,
    )


def _check_prompt(prompt_token_ids: list[int], info: ModelInfo) -> None:
    if not prompt_token_ids:
        raise InvalidArgument("prompt_token_ids", "must not be empty")
    if len(prompt_token_ids) >= info.max_context_tokens:
        raise InvalidArgument(
            "prompt_token_ids",
            f"{len(prompt_token_ids)} tokens leave no room to generate: the context is "
            f"{info.max_context_tokens} tokens, so at most {info.max_context_tokens - 1}",
        )
    if max(prompt_token_ids) >= info.vocab_size:  # one C-speed pass; find the index only on error
        i, token_id = next((i, t) for i, t in enumerate(prompt_token_ids) if t >= info.vocab_size)
        raise InvalidArgument(
            f"prompt_token_ids[{i}]", f"token id {token_id} is not below the vocab size {info.vocab_size}"
        )


def _check_block_hashes(pb_request: inference_pb2.GenerateTokensRequest, num_prompt_tokens: int) -> None:
    """Hashes are optional hints, but a list longer than the prompt's full blocks is a bug upstream."""
    num_hashes = len(pb_request.block_hashes)
    if not num_hashes:
        return
    block_size = pb_request.block_size_tokens
    if block_size == 0:
        raise InvalidArgument("block_size_tokens", "must be positive when block_hashes are given")
    num_full_blocks = num_prompt_tokens // block_size
    if num_hashes > num_full_blocks:
        raise InvalidArgument(
            "block_hashes",
            f"{num_hashes} hashes but the prompt has only {num_full_blocks} full blocks of {block_size} tokens",
        )


def output_to_pb(output: EngineOutput) -> inference_pb2.GenerateTokensResponse:
    response = inference_pb2.GenerateTokensResponse(
        sequence_index=output.sequence_index,
        token_ids=output.new_token_ids,
        finish_reason=pb.finish_reason_to_pb(output.finish_reason),
        error_message=output.error_message,
    )
    if output.logprobs:
        response.logprobs.extend(pb.logprobs_to_pb(output.logprobs))
    if output.stop_token_id is not None:
        response.stop_token_id = output.stop_token_id
    if output.is_finished:
        response.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=output.num_completion_tokens,
                cached_tokens=output.num_cached_tokens,
            )
        )
        response.timings.CopyFrom(
            common_pb2.Timings(
                queue_time_ns=output.queue_time_ns,
                time_to_first_token_ns=output.time_to_first_token_ns,
                total_time_ns=output.total_time_ns,
            )
        )
    return response

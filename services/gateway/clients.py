"""Typed async clients for the gateway's two hops: preprocess and inference.

Protobuf stops here: callers pass and receive the dataclasses below. Every call takes the
time left on the client's deadline (`timeout_s`, None = no deadline) so a deadline set at the
gateway bounds the whole chain. A gRPC error from a hop becomes a ServiceError with a precise
status (see `error_from_rpc`), which the gateway's interceptor sends on to the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.errors import RETRY_AFTER_MS_KEY, ServiceError, Unavailable
from llmserve.pb import chat_to_pb, finish_reason_from_pb, logprobs_from_pb, sampling_to_pb
from llmserve.sampling import ChatMessage, FinishReason, SamplingParams, TokenLogprob
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import inference_pb2, inference_pb2_grpc, preprocess_pb2, preprocess_pb2_grpc

log = logging.getLogger(__name__)

REQUEST_ID_METADATA_KEY = "x-request-id"

# Status codes that describe the request itself (bad input, full server, unknown model...): the
# client gets them as the hop sent them, message included.
_PASS_THROUGH_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


class DownstreamError(ServiceError):
    """An error status from preprocess or inference, forwarded with its code."""

    def __init__(self, code: grpc.StatusCode, message: str, *, retry_after_ms: int | None = None):
        super().__init__(message, retry_after_ms=retry_after_ms)
        self.code = code


def _retry_after_ms(error: grpc.aio.AioRpcError) -> int | None:
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_MS_KEY:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def error_from_rpc(service: str, error: grpc.aio.AioRpcError) -> ServiceError:
    """Map a hop's status to the one the gateway's client sees."""
    code, details = error.code(), error.details() or ""
    retry_after_ms = _retry_after_ms(error)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"{service} unavailable: {details}", retry_after_ms=retry_after_ms)
    if code in _PASS_THROUGH_CODES:
        return DownstreamError(code, details, retry_after_ms=retry_after_ms)
    return ServiceError(f"{service} failed: {code.name}: {details}")


# Preprocess fields that the gateway's clients know under another name: errors are re-labelled
# so the message names the field the client actually set.
_PREPROCESS_FIELDS_AS_CLIENT_FIELDS = {"max_tokens": "sampling.max_tokens"}


def _client_field_details(details: str) -> str:
    field, sep, problem = details.partition(": ")
    if sep and field in _PREPROCESS_FIELDS_AS_CLIENT_FIELDS:
        return f"{_PREPROCESS_FIELDS_AS_CLIENT_FIELDS[field]}: {problem}"
    return details


async def wait_until_serving(channel: grpc.aio.Channel, service: str, timeout_s: float) -> None:
    """Poll grpc health until the server says SERVING; raise Unavailable after `timeout_s`."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    delay_s = 0.05
    last_problem = "no answer yet"
    while True:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last_problem = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except grpc.aio.AioRpcError as error:
            last_problem = f"{error.code().name}: {error.details()}"
        time_left_s = deadline - time.monotonic()
        if time_left_s <= 0:
            raise Unavailable(f"{service} not serving after {timeout_s:.0f}s ({last_problem})")
        await asyncio.sleep(min(delay_s, time_left_s))
        delay_s = min(delay_s * 2, 1.0)


def _request_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_METADATA_KEY, request_id),)


# ---------------------------------------------------------------------------------------------
# Preprocess


@dataclass(frozen=True, slots=True)
class PromptInput:
    """What to generate from: raw prompt text, or chat turns (exactly one is set)."""

    prompt: str | None = None
    chat: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool | None = None  # None: the service default (true)


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A validated, tokenized prompt and the max_tokens preprocess resolved for it."""

    token_ids: list[int]
    block_hashes: list[int]
    block_size_tokens: int
    block_hash_version: int
    max_tokens: int
    preprocess_time_ns: int


class PreprocessClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = preprocess_pb2_grpc.PreprocessServiceStub(self._channel)

    async def wait_until_serving(self, timeout_s: float) -> None:
        await wait_until_serving(self._channel, f"preprocess at {self.address}", timeout_s)

    async def preprocess(
        self,
        request_id: str,
        prompt_input: PromptInput,
        *,
        max_tokens: int | None,
        timeout_s: float | None,
    ) -> PreparedPrompt:
        """Template, tokenize and validate; `max_tokens` None lets preprocess pick it."""
        request = preprocess_pb2.PreprocessRequest(request_id=request_id)
        if prompt_input.chat is not None:
            request.chat.messages.extend(chat_to_pb(list(prompt_input.chat)))
            if prompt_input.add_generation_prompt is not None:
                request.chat.add_generation_prompt = prompt_input.add_generation_prompt
        else:
            request.prompt = prompt_input.prompt or ""
        if max_tokens is not None:
            request.max_tokens = max_tokens
        try:
            response = await self._stub.Preprocess(
                request, timeout=timeout_s, metadata=_request_metadata(request_id)
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise DownstreamError(error.code(), _client_field_details(error.details() or "")) from None
            raise error_from_rpc("preprocess", error) from None
        return PreparedPrompt(
            token_ids=list(response.token_ids),
            block_hashes=list(response.block_hashes),
            block_size_tokens=response.block_size_tokens,
            block_hash_version=response.block_hash_version,
            max_tokens=response.max_tokens,
            preprocess_time_ns=response.preprocess_time_ns,
        )

    async def close(self) -> None:
        await self._channel.close()


# ---------------------------------------------------------------------------------------------
# Inference


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the inference replica serves (read once at start-up)."""

    model_name: str
    architecture: str
    max_context_tokens: int
    backend: str
    eos_token_ids: tuple[int, ...]


@dataclass(slots=True)
class TokenChunk:
    """Tokens of one inference stream message; the last one has finish_reason and usage."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    stop_token_id: int | None = None
    error_message: str = ""
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time_ns: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


def _chunk_from_pb(response: inference_pb2.GenerateTokensResponse) -> TokenChunk:
    return TokenChunk(
        token_ids=list(response.token_ids),
        logprobs=logprobs_from_pb(response.logprobs) if response.logprobs else None,
        finish_reason=finish_reason_from_pb(response.finish_reason),
        stop_token_id=response.stop_token_id if response.HasField("stop_token_id") else None,
        error_message=response.error_message,
        num_prompt_tokens=response.usage.prompt_tokens,
        num_completion_tokens=response.usage.completion_tokens,
        num_cached_tokens=response.usage.cached_tokens,
        queue_time_ns=response.timings.queue_time_ns,
    )


class TokenStream:
    """One in-flight inference GenerateTokens call: iterate for TokenChunks, `cancel` to drop it."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        try:
            async for response in self._call:
                yield _chunk_from_pb(response)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc("inference", error) from None

    def cancel(self) -> None:
        """Cancel the call (inference aborts the request); harmless once it has ended."""
        self._call.cancel()


class InferenceClient:
    def __init__(self, address: str, *, abort_timeout_s: float = 5.0):
        self.address = address
        self._abort_timeout_s = abort_timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        # Aborts run in the background so an ending request never waits for them; kept here so
        # they are not garbage-collected mid-flight and `close` can wait for them.
        self._pending_aborts: set[asyncio.Task] = set()

    async def wait_until_serving(self, timeout_s: float) -> None:
        await wait_until_serving(self._channel, f"inference at {self.address}", timeout_s)

    async def get_model_card(self, timeout_s: float | None = 10.0) -> ModelCard:
        try:
            response = await self._stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc("inference", error) from None
        info = response.model
        return ModelCard(
            model_name=info.model_name,
            architecture=info.architecture,
            max_context_tokens=info.max_context_tokens,
            backend=info.backend,
            eos_token_ids=tuple(info.eos_token_ids),
        )

    def generate(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        *,
        timeout_s: float | None,
        priority: int = 0,
    ) -> TokenStream:
        """Start generating; `sampling.max_tokens` must already be resolved."""
        request = inference_pb2.GenerateTokensRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling_to_pb(sampling),
            block_hashes=prompt.block_hashes,
            block_size_tokens=prompt.block_size_tokens,
            block_hash_version=prompt.block_hash_version,
            priority=priority,
        )
        call = self._stub.GenerateTokens(request, timeout=timeout_s, metadata=_request_metadata(request_id))
        return TokenStream(call)

    async def abort(self, request_id: str) -> bool:
        """Abort a request (idempotent); True if it was still running. Never raises."""
        try:
            response = await self._stub.Abort(
                inference_pb2.AbortRequest(request_id=request_id),
                timeout=self._abort_timeout_s,
                metadata=_request_metadata(request_id),
            )
        except grpc.aio.AioRpcError as error:
            log.warning("abort of %s failed: %s: %s", request_id, error.code().name, error.details())
            return False
        return response.was_running

    def abort_soon(self, request_id: str) -> None:
        """Send Abort in the background (safe to call from a task that is being cancelled)."""
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self._pending_aborts.add(task)
        task.add_done_callback(self._pending_aborts.discard)

    async def close(self) -> None:
        if self._pending_aborts:
            await asyncio.wait(self._pending_aborts, timeout=self._abort_timeout_s)
        await self._channel.close()


"""The gateway's typed async client for one inference replica.

Protobuf stops here: callers pass and receive the dataclasses below. A Generate call takes the
time left on the client's deadline (`timeout_s`, None = no deadline); a gRPC error becomes a
ServiceError (`hop_errors.error_from_rpc`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import grpc

from llmserve.errors import ServiceError
from llmserve.gateway.block_layout import BlockLayout
from llmserve.gateway.health import wait_until_serving
from llmserve.gateway.hop_errors import error_from_rpc
from llmserve.gateway.preprocess_client import PreparedPrompt
from llmserve.gateway.request_id import request_metadata
from llmserve.gateway.replica_stream import ReplicaStream
from llmserve.gateway.token_chunks import TokenChunk, chunk_from_pb
from llmserve.kv_events import KvEventBatch, batch_from_pb
from llmserve.pb import sampling_to_pb
from llmserve.sampling import SamplingParams
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the inference replica serves (read once at start-up)."""

    model_name: str
    architecture: str
    max_context_tokens: int
    eos_token_ids: tuple[int, ...]
    backend: str
    block_layout: BlockLayout


class KvEventsUnsupported(Exception):
    """The replica serves no WatchKvEvents (an older release): route to it by the gateway's own
    in-flight count, with no prefix index and no heartbeat."""


class TokenStream(Protocol):
    """One in-flight inference request: iterate for TokenChunks; `cancel` stops it on the
    replica (freeing its KV blocks) and is harmless once it has ended."""

    def __aiter__(self) -> AsyncIterator[TokenChunk]: ...

    def cancel(self) -> None: ...


class CallTokens:
    """A request on a GenerateTokens call of its own."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, request_id: str, client: "InferenceClient"):
        self._call = call
        self._request_id = request_id
        self._client = client
        self._failure: ServiceError | None = None

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        self._client.calls.add(self)
        try:
            async for response in self._call:
                self._client.last_response_s = time.monotonic()
                yield chunk_from_pb(response)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc("inference", error) from None
        except asyncio.CancelledError:
            if self._failure is None:
                raise
            raise self._failure from None  # `fail` cancelled the call, not our caller
        finally:
            self._client.calls.discard(self)

    def fail(self, error: ServiceError) -> None:
        self._failure = error
        self._call.cancel()

    def cancel(self) -> None:
        # Cancelling the call aborts the request on the replica; the Abort makes sure of it when
        # the cancel raced the request's start.
        self._call.cancel()
        self._client.abort_soon(self._request_id)


class InferenceClient:
    """`multiplex`: every request on one Multiplex stream (replica_stream.py), else one
    GenerateTokens call per request."""

    def __init__(self, address: str, *, multiplex: bool = True, abort_timeout_s: float = 5.0):
        self.address = address
        self._abort_timeout_s = abort_timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._replica_stream = ReplicaStream(self._stub) if multiplex else None
        self.calls: set[CallTokens] = set()  # requests on calls of their own, being read
        self.last_response_s = 0.0  # time.monotonic() of the last token message on a call
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
            eos_token_ids=tuple(info.eos_token_ids),
            backend=info.backend,
            block_layout=BlockLayout(
                info.block_size_tokens, info.block_hash_version, info.model_fingerprint, info.tokenizer_fingerprint
            ),
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
        """Start generating `prompt` with `sampling` (its max_tokens resolved by preprocess)."""
        request = inference_pb2.GenerateTokensRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling_to_pb(sampling),
            block_hashes=prompt.block_hashes,
            block_size_tokens=prompt.block_size_tokens,
            block_hash_version=prompt.block_hash_version,
            cache_salt=prompt.cache_salt,
            priority=priority,
            timeout_ms=max(1, int(timeout_s * 1000)) if timeout_s is not None else 0,
        )
        if self._replica_stream is not None:
            return self._replica_stream.generate(request)
        call = self._stub.GenerateTokens(request, timeout=timeout_s, metadata=request_metadata(request_id))
        return CallTokens(call, request_id, self)

    async def watch_kv_events(
        self, *, load_only: bool, heartbeat_interval_ms: int = 0
    ) -> AsyncIterator[KvEventBatch]:
        """The replica's WatchKvEvents stream, typed; a gRPC error becomes a ServiceError."""
        request = inference_pb2.WatchKvEventsRequest(heartbeat_interval_ms=heartbeat_interval_ms, load_only=load_only)
        call = self._stub.WatchKvEvents(request)
        try:
            async for message in call:
                yield batch_from_pb(message)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise KvEventsUnsupported(f"inference at {self.address} does not serve WatchKvEvents") from None
            raise error_from_rpc("inference", error) from None
        finally:
            call.cancel()

    @property
    def last_output_s(self) -> float:
        """time.monotonic() of the last token message from the replica, on any request."""
        stream_s = self._replica_stream.last_response_s if self._replica_stream is not None else 0.0
        return max(stream_s, self.last_response_s)

    def fail_in_flight(self, error: ServiceError) -> None:
        """End every request in flight on this replica with `error` (it stopped answering)."""
        if self._replica_stream is not None:
            self._replica_stream.fail_all(error)
        for tokens in list(self.calls):
            tokens.fail(error)

    async def abort(self, request_id: str) -> bool:
        """Abort a request (idempotent); True if it was still running. Never raises."""
        try:
            response = await self._stub.Abort(
                inference_pb2.AbortRequest(request_id=request_id),
                timeout=self._abort_timeout_s,
                metadata=request_metadata(request_id),
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
        if self._replica_stream is not None:
            await self._replica_stream.close()
        if self._pending_aborts:
            await asyncio.wait(self._pending_aborts, timeout=self._abort_timeout_s)
        await self._channel.close()

"""The Inference gRPC servicer: validates at the edge, converts, streams engine outputs.

Protobuf stops here (wire.py converts): requests become EngineRequest; the engine's outputs,
coalesced per sequence when the reader is behind (output_stream.py), become
GenerateTokensResponses (one call per request, for direct callers) or MultiplexResponses (many
requests on one stream, multiplex.py: how the gateway calls), both through one OutputStream.
Errors are raised as llmserve.errors types; the interceptor installed by create_server maps
them to status codes. A request whose deadline passed in the engine ends with
DEADLINE_EXCEEDED (wire.split_at_deadline).

Cancellation: when the client cancels or the deadline passes, grpc.aio cancels the handler
(asyncio.CancelledError at its current await). That closes the handler's OutputStream, which
detaches the request from the engine and aborts it, freeing its KV blocks.

WatchKvEvents serves the replica's KvEventLog (kv_event_log.py) as it is: snapshot, batches,
heartbeats; the stream ends when the log closes (the replica drains) and with
RESOURCE_EXHAUSTED when the subscriber fell too far behind.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from llmserve.bidi_stream import served
from llmserve.block_hash import HASH_VERSION
from llmserve.errors import FailedPrecondition, InvalidArgument
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.config import KV_EVENTS_HEARTBEAT_MS_RANGE
from llmserve.inference.engine.kv_block_import import KvPullRefused
from llmserve.inference.kv_event_log import KvEventLog
from llmserve.inference.kv_pull_endpoints import KvPullEndpoints
from llmserve.inference.kv_pull_wire import identity_from_pb, pin_to_pb
from llmserve.inference.multiplex import MultiplexedStream
from llmserve.inference.output_stream import OutputStream
from llmserve.inference.wire import deadline_ns, hint_from_pb, pin_request_from_pb, request_from_pb, split_at_deadline
from llmserve.kv_events import batch_to_pb
from llmserve.pb import MULTIPLEX_COLUMNS_METADATA, model_info_to_pb, output_to_pb, scope_to_pb
from llmserve.prompt_ids_region import local_scope
from llmserve.request_context import bind_request_id
from llmserve.v1 import inference_pb2, inference_pb2_grpc

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """`kv_events` is the log of `engine`'s cache (KvEventLog.of) and names the replica;
    `kv_pull` (--kv-pull) pins this replica's blocks for pullers and pulls requests' prefixes."""

    def __init__(self, engine: AsyncEngine, kv_events: KvEventLog, kv_pull: KvPullEndpoints | None = None):
        self._engine = engine
        self._kv_events = kv_events
        self._kv_pull = kv_pull

    async def GenerateTokens(
        self, request: inference_pb2.GenerateTokensRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateTokensResponse]:
        arrival_ns = time.monotonic_ns()
        bind_request_id(request.request_id)
        deadline = deadline_ns(request, arrival_ns, context.time_remaining())
        stream = OutputStream(self._engine)
        engine_request = request_from_pb(request, self._engine.model_info, arrival_ns, deadline)
        hint = hint_from_pb(request)
        pulled = None
        if hint is not None and self._kv_pull is not None:
            pulled = await self._kv_pull.puller.pull(engine_request, hint)
        stream.start(engine_request, pulled)  # no await since the import was sent: the core takes it first
        try:
            async for output in stream.outputs():
                tokens, deadline_error = split_at_deadline(output)
                if tokens is not None:
                    yield output_to_pb(tokens)
                if deadline_error is not None:
                    raise deadline_error
        finally:
            stream.close()

    async def Multiplex(
        self, request_iterator: AsyncIterator[inference_pb2.MultiplexRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.MultiplexResponse]:
        metadata = context.invocation_metadata() or ()
        stream = MultiplexedStream(
            self._engine,
            self._kv_pull.puller if self._kv_pull is not None else None,
            token_columns=MULTIPLEX_COLUMNS_METADATA in tuple(metadata),
        )
        async for response in served(stream.read_commands(request_iterator), stream.responses(), stream.close):
            yield response

    async def Abort(
        self, request: inference_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.AbortResponse:
        bind_request_id(request.request_id)
        return inference_pb2.AbortResponse(was_running=self._engine.abort(request.request_id))

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetModelInfoResponse:
        info = self._engine.model_info
        model = model_info_to_pb(
            info, HASH_VERSION, architecture=info.architecture, vocab_size=info.vocab_size, dtype=info.dtype,
            backend=info.backend, device=info.device,
        )
        return inference_pb2.GetModelInfoResponse(
            model=model, replica_id=self._kv_events.replica_id, takes_prompt_token_id_bytes=True,
            takes_prompt_token_ids_in_region=True, shared_memory=scope_to_pb(local_scope()),
        )

    async def GetLoad(
        self, request: inference_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetLoadResponse:
        load = self._engine.load()
        return inference_pb2.GetLoadResponse(
            replica_id=self._kv_events.replica_id,
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

    async def PinKvBlocks(
        self, request: inference_pb2.PinKvBlocksRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.PinKvBlocksResponse:
        if self._kv_pull is None:
            raise FailedPrecondition("this replica does not export its KV pool (started without --kv-pull)")
        engine_request, lease_ms = pin_request_from_pb(request, self._engine.model_info)
        try:
            pin_id, source = await self._kv_pull.pins.pin(
                engine_request, request.max_blocks, identity_from_pb(request.puller), lease_ms / 1000
            )
        except (KvPullRefused, NotImplementedError) as refused:
            raise FailedPrecondition(str(refused)) from None
        return pin_to_pb(pin_id, source, lease_ms)

    async def ReleaseKvBlocks(
        self, request: inference_pb2.ReleaseKvBlocksRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ReleaseKvBlocksResponse:
        was_pinned = self._kv_pull is not None and await self._kv_pull.pins.release(request.pin_id)
        return inference_pb2.ReleaseKvBlocksResponse(was_pinned=was_pinned)

    async def WatchKvEvents(
        self, request: inference_pb2.WatchKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.WatchKvEventsResponse]:
        interval_s = _heartbeat_interval_s(request, self._kv_events.default_heartbeat_interval_s)
        async with aclosing(self._kv_events.subscribe(request.load_only, interval_s)) as batches:
            async for batch in batches:
                yield batch_to_pb(batch)


def _heartbeat_interval_s(request: inference_pb2.WatchKvEventsRequest, default_s: float) -> float:
    if not request.heartbeat_interval_ms:
        return default_s
    low, high = KV_EVENTS_HEARTBEAT_MS_RANGE
    if not low <= request.heartbeat_interval_ms <= high:
        raise InvalidArgument("heartbeat_interval_ms", f"must be 0 (the replica's default) or in [{low}, {high}]")
    return request.heartbeat_interval_ms / 1000

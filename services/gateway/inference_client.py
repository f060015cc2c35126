"""The gateway's typed async client for one inference replica.

Protobuf stops here: callers pass and receive the dataclasses below and EngineOutputs. Every
request goes on the replica's one Multiplex stream (replica_stream.py) with the time left on
the client's deadline (`timeout_s`, None = no deadline); a gRPC error becomes a ServiceError
(`hop_errors.error_from_rpc`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from llmserve import token_id_bytes
from llmserve.errors import ServiceError
from llmserve.gateway.block_layout import BlockLayout
from llmserve.gateway.health import wait_until_serving
from llmserve.gateway.hop_errors import call_hop, error_from_rpc
from llmserve.gateway.preprocess_client import PreparedPrompt
from llmserve.gateway.replica_stream import MultiplexedTokens, ReplicaStream
from llmserve.gateway.slow_reader import SlowReaderBounds
from llmserve.gateway.stream_interval import NO_INTERVAL, StreamInterval
from llmserve.kv_events import KvEventBatch, batch_from_pb
from llmserve.pb import region_ids_to_pb, sampling_to_pb, scope_from_pb
from llmserve.prompt_ids_region import local_scope
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


class InferenceClient:
    """`slow_readers`: when a request's client counts as not reading (gateway.slow_reader);
    `stream_interval`: the least time between two of a request's outputs taken while the
    worker is busy (gateway.stream_interval)."""

    def __init__(self, address: str, *, slow_readers: SlowReaderBounds = SlowReaderBounds(),
                 stream_interval: StreamInterval = NO_INTERVAL):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._replica_stream = ReplicaStream(self._stub, slow_readers, stream_interval)
        # Whether the replica reads prompt_token_id_bytes, from its model card (a release before
        # would ignore them, so until the card is read the ids go as prompt_token_ids).
        self._takes_token_id_bytes = False
        # Whether it reads prompt ids from a ring this process can map (the same /dev/shm):
        # then a prompt whose ids preprocess answered in its ring is relayed by reference.
        self._reads_shared_ids = False

    async def wait_until_serving(self, timeout_s: float) -> None:
        await wait_until_serving(self._channel, f"inference at {self.address}", timeout_s)

    async def get_model_card(self, timeout_s: float | None = 10.0) -> ModelCard:
        response = await call_hop(
            "inference", self._stub.GetModelInfo, inference_pb2.GetModelInfoRequest(), timeout=timeout_s
        )
        info = response.model
        self._takes_token_id_bytes = response.takes_prompt_token_id_bytes
        self._reads_shared_ids = response.takes_prompt_token_ids_in_region and local_scope().shares_with(
            scope_from_pb(response.shared_memory)
        )
        return ModelCard(
            model_name=info.model_name,
            architecture=info.architecture,
            max_context_tokens=info.max_context_tokens,
            eos_token_ids=tuple(info.eos_token_ids),
            backend=info.backend,
            block_layout=BlockLayout.of_model_info(info),
        )

    def generate(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        *,
        timeout_s: float | None,
        priority: int = 0,
        kv_pull: tuple[str, int] | None = None,
    ) -> MultiplexedTokens:
        """Start generating `prompt` with `sampling` (its max_tokens resolved by preprocess);
        `kv_pull`: (source replica's address, blocks it holds) to pull the prefix from."""
        request = inference_pb2.GenerateTokensRequest(
            request_id=request_id,
            sampling=sampling_to_pb(sampling),
            block_hashes=prompt.block_hashes,
            block_size_tokens=prompt.block_size_tokens,
            block_hash_version=prompt.block_hash_version,
            cache_salt=prompt.cache_salt,
            priority=priority,
            timeout_ms=max(1, int(timeout_s * 1000)) if timeout_s is not None else 0,
        )
        if self._reads_shared_ids and prompt.can_relay_region():
            request.prompt_token_ids_in_region.CopyFrom(region_ids_to_pb(prompt.ids_in_region))
        elif self._takes_token_id_bytes:
            request.prompt_token_id_bytes = prompt.inline_token_id_bytes()
        else:
            request.prompt_token_ids.extend(token_id_bytes.unpack(prompt.inline_token_id_bytes()))
        if kv_pull is not None:
            request.kv_pull.CopyFrom(inference_pb2.KvPullHint(source_address=kv_pull[0], num_blocks=kv_pull[1]))
        return self._replica_stream.generate(request)

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
        return self._replica_stream.last_response_s

    def fail_in_flight(self, error: ServiceError) -> None:
        """End every request in flight on this replica with `error` (it stopped answering)."""
        self._replica_stream.fail_all(error)

    async def close(self) -> None:
        await self._replica_stream.close()
        await self._channel.close()

"""KvPuller: a request's prefix KV pulled from the co-located replica that holds it, before the
request is submitted (issue 22; docs/transport.md, "KV pull").

    target (this replica)                                  source (KvPullHint.source_address)
    PinKvBlocks(prompt, salt, our identity) ─────────────▶ pins its cached blocks of the prompt
    ◀──────────── pin id, block ids, pool layout, region offer
    engine core: kv_import (map the region once, copy the blocks we lack, register them), sent
    and then, not waiting for it, the request: the core applies both in one pass between two
    steps, the import first, so the scheduler finds the prefix in our cache
    ReleaseKvBlocks(pin id) ─────────────────────────────▶ unpins (else its lease does), once
    the core has answered the import

A pull never fails the request: whatever goes wrong (the source gone or refusing, the blocks
evicted, no shared memory, no room) pulls less or nothing, and the engine computes the rest.
Each such fallback is logged and counted by reason (llmserve_kv_pull_failures_total).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from llmserve.errors import ServiceError
from llmserve.inference import kv_pull_metrics as metrics
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.kv_block_import import KvPullRefused
from llmserve.inference.engine.types import EngineRequest
from llmserve.inference.kv_pull_wire import identity_to_pb, pin_from_pb
from llmserve.tensor_transport import PeerIdentity
from llmserve.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

# The source answers between two of its engine steps: a long CPU prefill step may take seconds.
PIN_TIMEOUT_S = 10.0
RELEASE_TIMEOUT_S = 5.0
# The source drops the pin by itself after this long, should the release never come.
PIN_LEASE_MS = 30_000
# Channels kept open to sources (co-located replicas: a handful); past it the oldest is closed,
# so that hints naming ever new addresses cannot grow them without bound.
MAX_SOURCES = 64


@dataclass(frozen=True, slots=True)
class KvPullHint:
    source_address: str
    num_blocks: int  # the blocks the source is believed to hold; 0: unknown


@dataclass(frozen=True, slots=True)
class PendingImport:
    """An import sent to our engine core and not waited for: `imported` is the core's answer
    (KvImport, or the refusal), set before the outputs of the step that follows it."""

    imported: asyncio.Future
    block_size_tokens: int

    def num_tokens(self) -> int:
        """The tokens pulled, once the core has answered (0 before, and when it refused)."""
        done = self.imported.done() and not self.imported.cancelled() and self.imported.exception() is None
        return self.imported.result().num_blocks * self.block_size_tokens if done else 0


class KvPuller:
    """Used on the event loop."""

    def __init__(self, engine: AsyncEngine):
        self._engine = engine
        # The engine core's (the reader's) identity, asked of it on the first pull.
        self._identity: PeerIdentity | None = None
        self._stubs: dict[str, tuple[grpc.aio.Channel, inference_pb2_grpc.InferenceServiceStub]] = {}
        # The region each source's pool was last offered as: mapped in the engine core until the
        # source is gone or restarted (a mapping keeps a dead process's memory allocated).
        self._regions: dict[str, str] = {}
        self._releases: set[asyncio.Task] = set()  # imports not yet answered, releases not yet sent

    async def pull(self, request: EngineRequest, hint: KvPullHint) -> PendingImport | None:
        """Pin what the source holds of `request`'s prompt and send our engine core the import,
        not waiting for it: the request submitted next is applied after it, in the same pass
        between two steps. None when it fell back to recomputing everything (never raises)."""
        started_s = time.perf_counter()
        stub = self._stub(hint.source_address)
        try:
            identity = await self._reader_identity()
        except (KvPullRefused, ServiceError, NotImplementedError) as error:
            _fell_back(getattr(error, "reason", "engine"), f"{type(error).__name__}: {error}")
            return None
        try:
            pinned = await stub.PinKvBlocks(self._pin_request(request, hint, identity), timeout=PIN_TIMEOUT_S)
            metrics.record_phase("pin", time.perf_counter() - started_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                await self._forget(hint.source_address, "")
            _fell_back(_rpc_reason(error), f"PinKvBlocks at {hint.source_address}: {error.code().name} {error.details()}")
            return None
        await self._forget(hint.source_address, pinned.region.region_id)
        if not pinned.pin_id:
            _fell_back("nothing_cached", f"{hint.source_address} holds none of the prompt")
            return None
        if hint.num_blocks > len(pinned.block_ids):
            _fell_back("evicted", f"{hint.source_address} held {len(pinned.block_ids)} of {hint.num_blocks} blocks")
        try:
            imported = self._engine.call_core_soon("kv_import", request, pin_from_pb(pinned))
        except (ServiceError, NotImplementedError, ValueError) as error:
            self._release_soon(stub, pinned.pin_id)
            _fell_back("engine", f"{type(error).__name__}: {error}")
            return None
        pending = PendingImport(imported, pinned.layout.block_size_tokens)
        self._track(self._finish(pending, stub, pinned.pin_id, started_s, time.perf_counter()))
        return pending

    async def close(self) -> None:
        if self._releases:  # the last releases; a pin not released in time ends with its lease
            _, pending = await asyncio.wait(self._releases, timeout=RELEASE_TIMEOUT_S)
            for task in pending:
                task.cancel()
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()

    async def _forget(self, address: str, region_id: str) -> None:
        """`address` now offers `region_id` ("": nothing, it is gone): drop the mapping of the
        region it offered before, if another."""
        previous = self._regions.pop(address, "")
        if region_id:
            self._regions[address] = region_id
        if previous and previous != region_id:
            try:
                await self._engine.call_core("kv_forget", previous)
            except (ServiceError, NotImplementedError) as error:
                log.warning("could not drop the mapping of %s's old pool: %s", address, error)

    async def _reader_identity(self) -> PeerIdentity:
        if self._identity is None:
            self._identity = await self._engine.call_core("kv_identity")
        return self._identity

    def _pin_request(
        self, request: EngineRequest, hint: KvPullHint, identity: PeerIdentity
    ) -> inference_pb2.PinKvBlocksRequest:
        # The request's block hashes go along (checked on arrival here as the source checks
        # them), so the source's core, usually the busy replica, does not hash the prompt again.
        return inference_pb2.PinKvBlocksRequest(
            prompt_token_ids=request.prompt_token_ids, cache_salt=request.cache_salt, max_blocks=hint.num_blocks,
            puller=identity_to_pb(identity), lease_ms=PIN_LEASE_MS, block_hashes=request.block_hashes,
            block_size_tokens=request.block_size_tokens, block_hash_version=request.block_hash_version,
        )

    async def _finish(self, pending: PendingImport, stub: inference_pb2_grpc.InferenceServiceStub, pin_id: str,
                      started_s: float, import_sent_s: float) -> None:
        """Once the core answered the import: count it (or its fallback), then release the pin
        (the copies are done when the core answers)."""
        try:
            imported = await pending.imported
        except KvPullRefused as refused:
            _fell_back(refused.reason, str(refused))
        except Exception as error:  # noqa: BLE001 — the core's failure, whatever it was: we recompute
            _fell_back("engine", f"{type(error).__name__}: {error}")
        else:
            metrics.record_phase("import", time.perf_counter() - import_sent_s)
            metrics.record_pulled(imported, time.perf_counter() - started_s)
        finally:
            await self._release(stub, pin_id)

    def _release_soon(self, stub: inference_pb2_grpc.InferenceServiceStub, pin_id: str) -> None:
        self._track(self._release(stub, pin_id))

    def _track(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, stub: inference_pb2_grpc.InferenceServiceStub, pin_id: str) -> None:
        try:
            await stub.ReleaseKvBlocks(inference_pb2.ReleaseKvBlocksRequest(pin_id=pin_id), timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:  # its lease releases it
            log.warning("ReleaseKvBlocks failed (%s): the pin's lease will release it", error.code().name)

    def _stub(self, address: str) -> inference_pb2_grpc.InferenceServiceStub:
        if address not in self._stubs:
            if len(self._stubs) >= MAX_SOURCES:
                oldest = next(iter(self._stubs))
                asyncio.ensure_future(self._stubs.pop(oldest)[0].close(grace=PIN_TIMEOUT_S))
            channel = grpc.aio.insecure_channel(address)
            self._stubs[address] = (channel, inference_pb2_grpc.InferenceServiceStub(channel))
        return self._stubs[address][1]


def _rpc_reason(error: grpc.aio.AioRpcError) -> str:
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return "source_unavailable"
    return "refused"


def _fell_back(reason: str, message: str) -> int:
    """Log and count a fallback to recomputing; 0 tokens pulled."""
    log.info("KV pull fell back to recomputing (%s): %s", reason, message)
    metrics.record_failure(reason)
    return 0

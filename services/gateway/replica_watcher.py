"""ReplicaWatcher: one replica's WatchKvEvents stream, kept open for as long as the replica is known.

    WatchKvEvents ─▶ batch ─▶ Replica.observe (liveness, load)
                          └─▶ MemoryPrefixIndex.apply (full events; not with Redis: load_only)

- A RESYNC from the index (a gap in the numbers, a new incarnation) ends the subscription and
  starts a new one at once: its first batch is a snapshot. So does RESOURCE_EXHAUSTED (this
  gateway read too slowly and the replica cut the subscription off).
- The stream failing, ending, or the replica staying silent past the heartbeat TTL makes it
  unroutable and drops its index entries; the watcher then reconnects every `retry_interval_s`.
  Silent means no batch and no tokens for any request: a replica busy generating may send a
  heartbeat late, and is not gone.
- Silent past the TTL (a hung process keeps its connections open), the replica's in-flight
  requests end with UNAVAILABLE instead of waiting for tokens that will never come.
- A replica without WatchKvEvents (UNIMPLEMENTED) is routed on the gateway's own count alone.
- After a loss the process at the address may be another one (restarted with other flags, or
  another release): its model card is read again before it is routable, and a block layout
  that no longer matches keeps it out (an ERROR, once per layout) until one that matches comes
  back. The card also says again whether it reads prompt ids as bytes.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from llmserve.errors import ServiceError, Unavailable
from llmserve.gateway.block_layout import BlockLayout, BlockLayoutMismatch, check_block_layouts
from llmserve.gateway.hop_errors import DownstreamError
from llmserve.gateway.inference_client import KvEventsUnsupported
from llmserve.gateway.replica import Replica
from llmserve.kv_events import KvEventBatch
from llmserve.prefix_index import ApplyOutcome, PrefixIndex

log = logging.getLogger(__name__)

DEFAULT_RETRY_INTERVAL_S = 0.5


class ReplicaWatcher:
    """`events_index`: the in-memory index the events go to; None subscribes with load_only.
    `block_layout`: what the replica's card must say after a loss (the card was read when the
    replica joined)."""

    def __init__(
        self,
        replica: Replica,
        events_index: PrefixIndex | None,
        *,
        block_layout: BlockLayout,
        heartbeat_interval_ms: int = 0,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
    ):
        self._replica = replica
        self._index = events_index
        self._block_layout = block_layout
        self._heartbeat_interval_ms = heartbeat_interval_ms
        self._retry_interval_s = retry_interval_s
        self._card_is_stale = False
        self._mismatch_logged = ""

    async def run(self) -> None:
        """Follow the replica until cancelled."""
        while True:
            try:
                if self._card_is_stale:
                    await self._read_card()
                await self._follow()
                continue  # resync: subscribe again for a snapshot
            except KvEventsUnsupported as error:
                log.warning("%s; routing to it without a prefix index", error)
                self._replica.mark_unwatched()
                return
            except DownstreamError as error:
                if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # we fell behind; it is fine
                    await self._drop_entries()
                    continue
                await self._lose(error.message)
            except TimeoutError:
                await self._lose(f"no heartbeat for {self._replica.heartbeat_ttl_s:.1f}s")
            except BlockLayoutMismatch as mismatch:
                if str(mismatch) != self._mismatch_logged:
                    log.error("inference at %s left out of routing: %s", self._replica.address, mismatch)
                    self._mismatch_logged = str(mismatch)
                await self._lose(str(mismatch))
            except (ServiceError, StopAsyncIteration) as error:
                await self._lose(getattr(error, "message", "its event stream ended"))
            if self._replica.silent_for_s > self._replica.heartbeat_ttl_s:
                self._replica.client.fail_in_flight(
                    Unavailable(f"inference unavailable: replica at {self._replica.address} stopped answering")
                )
            await asyncio.sleep(self._retry_interval_s)

    async def _follow(self) -> None:
        """Read batches until the index asks for a resync; raise when the stream is lost."""
        stream = self._replica.client.watch_kv_events(
            load_only=self._index is None, heartbeat_interval_ms=self._heartbeat_interval_ms
        )
        async with aclosing(stream) as batches:
            while True:
                batch = await self._next_batch(batches)
                was_live = self._replica.is_live
                self._replica.observe(batch)
                if not was_live:
                    log.info("replica %s at %s is live", batch.replica_id, self._replica.address)
                if self._index is not None and await self._index.apply(batch) is ApplyOutcome.RESYNC:
                    log.info("replica %s: events missed; subscribing again for a snapshot", batch.replica_id)
                    return

    async def _next_batch(self, batches: AsyncIterator[KvEventBatch]) -> KvEventBatch:
        """The next batch; TimeoutError once the replica has been silent for its TTL."""
        next_batch = asyncio.ensure_future(anext(batches))
        try:
            while not next_batch.done():
                await asyncio.wait({next_batch}, timeout=self._replica.heartbeat_ttl_s)
                if not next_batch.done() and self._replica.silent_for_s >= self._replica.heartbeat_ttl_s:
                    raise TimeoutError
            return next_batch.result()
        finally:
            if not next_batch.done():
                # Wait for the cancel to land: the stream cannot be closed while it is being read.
                next_batch.cancel()
                await asyncio.gather(next_batch, return_exceptions=True)

    async def _read_card(self) -> None:
        """Read the card of whatever process now serves the address; BlockLayoutMismatch when
        its blocks are not the gateway's."""
        try:
            card = await self._replica.client.get_model_card()
        except DownstreamError as error:  # not the event stream's error (its RESOURCE_EXHAUSTED: we fell behind)
            raise Unavailable(f"its model card could not be read: {error.message}") from None
        check_block_layouts(self._block_layout, {self._replica.address: card.block_layout})
        self._card_is_stale = False
        if self._mismatch_logged:
            log.info("inference at %s matches the block layout again", self._replica.address)
            self._mismatch_logged = ""

    async def _lose(self, reason: str) -> None:
        if self._replica.is_live:
            log.warning("%r is not routable: %s", self._replica, reason)
        self._replica.is_live = False
        self._card_is_stale = True
        await self._drop_entries()

    async def _drop_entries(self) -> None:
        if self._index is not None and self._replica.replica_id is not None:
            await self._index.remove_replica(self._replica.replica_id)

"""KvPins: the blocks this replica has pinned for co-located pullers (PinKvBlocks, issue 22),
each with a lease.

A pin holds the cached blocks of one prompt in the engine core (TorchEngineCore.kv_pin: a
reference each, so they are neither reused nor evicted) until its puller releases it
(ReleaseKvBlocks) or its lease ends, whichever comes first: a puller that dies mid-copy cannot
hold blocks forever. Every pin is released exactly once. A pin whose PinKvBlocks call was
cancelled while the core pinned is released as soon as the core answers.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

from llmserve.errors import Unavailable
from llmserve.inference import kv_pull_metrics as metrics
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.kv_block_import import KvPullSource
from llmserve.inference.engine.types import EngineRequest
from llmserve.tensor_transport import PeerIdentity

log = logging.getLogger(__name__)



@dataclass(slots=True)
class _Pin:
    block_ids: list[int]
    expiry: asyncio.TimerHandle | None = None


class KvPins:
    """Used on the event loop."""

    def __init__(self, engine: AsyncEngine):
        self._engine = engine
        self._pins: dict[str, _Pin] = {}

    async def pin(
        self, request: EngineRequest, max_blocks: int, puller: PeerIdentity, lease_s: float
    ) -> tuple[str, KvPullSource]:
        """(pin id, where the blocks lie); pin id "" when none of the prompt is cached here.
        Raises what the core raised (KvPullRefused: not enabled)."""
        # Mid-step: the replica pulled from is usually the busy one (engine/mid_step_calls.py).
        call = asyncio.ensure_future(self._engine.call_core_mid_step("kv_pin", request, max_blocks, puller))
        try:
            source = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._release_abandoned)
            raise
        if not source.block_ids:
            return "", source
        pin_id = secrets.token_hex(8)
        pin = self._pins[pin_id] = _Pin(list(source.block_ids))
        pin.expiry = asyncio.get_running_loop().call_later(lease_s, self._expire, pin_id)
        metrics.record_pinned(len(pin.block_ids))
        return pin_id, source

    async def release(self, pin_id: str) -> bool:
        """Drop the pin; False when it is unknown (released before, or its lease ended)."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        pin.expiry.cancel()
        await self._unpin(pin.block_ids)
        return True

    async def release_all(self) -> None:
        for pin_id in list(self._pins):
            await self.release(pin_id)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def _expire(self, pin_id: str) -> None:
        pin = self._pins.pop(pin_id, None)
        if pin is not None:
            log.warning("a KV pin's lease ended before its puller released it (%d blocks)", len(pin.block_ids))
            metrics.record_lease_expired()
            asyncio.ensure_future(self._unpin(pin.block_ids))

    def _release_abandoned(self, call: asyncio.Future) -> None:
        if not call.cancelled() and call.exception() is None and call.result().block_ids:
            asyncio.ensure_future(self._unpin(list(call.result().block_ids)))

    async def _unpin(self, block_ids: list[int]) -> None:
        try:
            await self._engine.call_core("kv_release", block_ids)
        except Unavailable:  # the engine stopped: its blocks went with it
            log.info("%d pinned KV blocks not released: the engine has stopped", len(block_ids))
        except Exception:  # noqa: BLE001 — a bug of ours: the blocks stay pinned until the engine stops
            log.exception("releasing %d pinned KV blocks failed", len(block_ids))

"""What a replica started with --kv-pull serves and does for KV pull (issue 22): the pins it
holds for pullers (KvPins, PinKvBlocks / ReleaseKvBlocks) and the pulls it makes for requests
that name a source (KvPuller)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.kv_pins import KvPins
from llmserve.inference.kv_puller import KvPuller


@dataclass(frozen=True, slots=True)
class KvPullEndpoints:
    pins: KvPins
    puller: KvPuller

    @classmethod
    def of(cls, engine: AsyncEngine) -> KvPullEndpoints:
        return cls(KvPins(engine), KvPuller(engine))

    async def close(self) -> None:
        await self.pins.release_all()
        await self.puller.close()

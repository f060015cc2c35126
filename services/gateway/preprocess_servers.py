"""PreprocessServers: the preprocess servers discovery finds, admitted into the gateway's pool.

`--preprocess` targets are found as inference's are (gateway.discovery: `host:port`, or
`dns:///name:port` resolved again every --resolve-interval-s). An address is admitted, and
the pool (preprocess_pool) starts calling it, once it reports SERVING and its PreprocessCard
(block layout, context, prompt byte cap) equals that of the first server admitted: servers
that tokenize or hash differently would make prefix-cache hits depend on which one a request
met, and the gateway sized its receive limit by the first one's cap. One that differs is
refused with a log line naming both values and is never called. An address DNS stops listing
leaves the pool (its client closes once its calls end); one it lists again is checked again.

Start-up (`start`) resolves the targets and returns the first admitted server's info as soon
as one is (the others join when they serve); Unavailable if none serves within
--downstream-ready-timeout-s. Then the pool's health checks run every
HEALTH_CHECK_INTERVAL_S: a server that stops serving is skipped before a request meets it,
and one that serves again gets calls again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from llmserve.errors import ServiceError, Unavailable
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.discovery import AddressWatcher
from llmserve.gateway.preprocess_client import PreprocessClient, PreprocessCard
from llmserve.gateway.preprocess_pool import PreprocessPool
from llmserve.prompt_ids_region import local_scope

log = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 1.0


class PreprocessServers:
    """Owns the pool (`pool`: what requests are sent through) and the tasks that feed it."""

    def __init__(self, config: GatewayConfig):
        self._config = config
        self._watcher = AddressWatcher(config.preprocess_targets, config.resolve_interval_s)
        self._listed: frozenset[str] = frozenset()  # what discovery names now
        self._admitted: tuple[str, ...] = ()  # what the pool calls; replaced, never mutated
        self._refused: set[str] = set()
        self._joining: set[str] = set()
        self._reference: tuple[str, PreprocessCard] | None = None  # the first admitted
        self._has_admitted = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        # Servers whose prompt ids ring this process can map (same host, same /dev/shm): they
        # are asked to answer long prompts' ids there (--prompt-ids-region-from).
        self._scope = local_scope()
        self._sharing_memory: set[str] = set()
        self.pool = PreprocessPool(lambda: self._admitted, ids_in_region_from=self._ids_in_region_from)

    async def start(self) -> PreprocessCard:
        """Resolve, wait for a first server to be admitted; its info."""
        self._listed = await self._watcher.resolve_some(self._config.downstream_ready_timeout_s)
        targets = ", ".join(map(str, self._config.preprocess_targets))
        if not self._listed:
            raise Unavailable(f"preprocess: no address found for {targets}")
        joins = [self._spawn(self._join(address)) for address in sorted(self._listed)]
        admitted = self._spawn(self._has_admitted.wait())
        await asyncio.wait([admitted, self._spawn(asyncio.wait(joins))], return_when=asyncio.FIRST_COMPLETED)
        if self._reference is None:
            raise Unavailable(f"preprocess: no server of {targets} could be admitted (see the log lines above)")
        if not self._watcher.is_static:
            self._spawn(self._follow_discovery())
        self._spawn(self.pool.run_health_checks(HEALTH_CHECK_INTERVAL_S))
        return self._reference[1]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()

    async def _follow_discovery(self) -> None:
        async for addresses in self._watcher.changes(self._listed):
            self._listed = addresses
            for address in sorted(addresses - set(self._admitted) - self._refused - self._joining):
                self._spawn(self._join(address))
            for address in sorted(set(self._admitted) - addresses):
                log.info("preprocess at %s left (no longer in DNS)", address)
            self._admitted = tuple(address for address in self._admitted if address in addresses)
            self._refused &= addresses

    async def _join(self, address: str) -> None:
        """Wait until `address` serves, then admit or refuse it."""
        self._joining.add(address)
        try:
            info = await self._info_of(address)
        except ServiceError as error:
            reason = error.message.removeprefix(f"preprocess at {address} ")  # named once is enough
            log.error("preprocess at %s not added: %s", address, reason)
            self._refused.add(address)
            return
        finally:
            self._joining.discard(address)
        if address not in self._listed:
            return
        if self._reference is None:
            self._reference = (address, info)
        reference_address, reference = self._reference
        if info != reference:
            log.error(
                "preprocess at %s refused: its model info differs from preprocess at %s's (%s); start every "
                "preprocess server with the same --model and engine flags", address, reference_address,
                ", ".join(_differences(info, reference)),
            )
            self._refused.add(address)
            return
        shares_memory = self._config.prompt_ids_region_from > 0 and self._scope.shares_with(info.shared_memory)
        if shares_memory:
            self._sharing_memory.add(address)
        log.info("preprocess at %s joined%s", address,
                 f" (prompts of {self._config.prompt_ids_region_from}+ tokens: ids in its shared-memory ring)"
                 if shares_memory else "")
        self._admitted = (*self._admitted, address)
        self._has_admitted.set()

    def _ids_in_region_from(self, address: str) -> int:
        return self._config.prompt_ids_region_from if address in self._sharing_memory else 0

    async def _info_of(self, address: str) -> PreprocessCard:
        client = PreprocessClient(address)
        try:
            await client.wait_until_serving(self._config.downstream_ready_timeout_s)
            return await client.get_info()
        finally:
            await client.close()

    def _spawn(self, work) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)  # kept so it is not garbage-collected mid-flight
        task.add_done_callback(self._tasks.discard)
        return task


def _differences(info: PreprocessCard, reference: PreprocessCard) -> list[str]:
    """'name value vs reference value' for each field of the info (the layout's too) that differs."""
    fields, reference_fields = _flat_fields(info), _flat_fields(reference)
    return [f"{name} {value!r} vs {reference_fields[name]!r}"
            for name, value in fields.items() if value != reference_fields[name]]


def _flat_fields(info: PreprocessCard) -> dict[str, object]:
    fields = dataclasses.asdict(info)
    fields.pop("shared_memory")  # not compared: servers on other hosts serve alike
    return {**fields.pop("block_layout"), **fields}

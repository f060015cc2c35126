"""ReplicaSet: the inference replicas discovery found, each with its client and watcher.

Start-up (`start`): resolve the targets, wait (bounded) for every replica found to serve,
read their model cards and refuse to start on a block-layout mismatch (BlockLayoutMismatch),
start a watcher per replica and wait (bounded) for each replica's first heartbeat, so the
first request already sees them live. Then, for dns:/// targets, follow discovery: a new
address joins once it serves and its layout matches preprocess's (a mismatch is logged and the
address kept out); an address DNS no longer lists stops taking requests at once, its entries
leave the index, and its client closes once its in-flight requests have ended.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from llmserve.gateway.block_layout import BlockLayout, BlockLayoutMismatch, check_block_layouts
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.discovery import AddressWatcher
from llmserve.gateway.inference_client import InferenceClient, ModelCard
from llmserve.gateway.replica import Replica
from llmserve.gateway.replica_watcher import ReplicaWatcher
from llmserve.errors import ServiceError, Unavailable
from llmserve.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

# At start-up, how long to wait for a replica's first heartbeat before serving without it.
FIRST_HEARTBEAT_TIMEOUT_S = 10.0
# How long a replica DNS dropped may finish its in-flight requests before its client closes.
DRAIN_TIMEOUT_S = 60.0
_DRAIN_POLL_S = 0.1


class ReplicaSet:
    """`events_index`: where watchers apply full events (None: Redis, watchers load_only)."""

    def __init__(self, config: GatewayConfig, layout: BlockLayout, events_index: PrefixIndex | None):
        self._config = config
        self._layout = layout
        self._events_index = events_index
        self._addresses = AddressWatcher(config.inference_targets, config.resolve_interval_s)
        self._replicas: dict[str, Replica] = {}  # by address, in the order they joined
        self._refused: set[str] = set()  # addresses whose layout does not match
        self._tasks: dict[str, asyncio.Task] = {}  # address → its watcher
        self._background: set[asyncio.Task] = set()

    def live(self) -> list[Replica]:
        return [replica for replica in self._replicas.values() if replica.is_live]

    async def start(self) -> ModelCard:
        """Bring up the replicas found now; the first one's model card."""
        addresses = await self._addresses.resolve_some(self._config.downstream_ready_timeout_s)
        if not addresses:
            raise Unavailable(f"inference: no address found for {', '.join(map(str, self._config.inference_targets))}")
        ordered = sorted(addresses)
        clients = [self._client(address) for address in ordered]
        try:
            timeout_s = self._config.downstream_ready_timeout_s
            await asyncio.gather(*(client.wait_until_serving(timeout_s) for client in clients))
            cards = await asyncio.gather(*(client.get_model_card() for client in clients))
            check_block_layouts(self._layout, dict(zip(ordered, (card.block_layout for card in cards))))
        except BaseException:
            await asyncio.gather(*(client.close() for client in clients))
            raise
        replicas = [self._add(address, client) for address, client in zip(ordered, clients)]
        await self._wait_until_heard(replicas)
        if not self._addresses.is_static:
            self._spawn(self._follow_discovery(frozenset(addresses)))
        return cards[0]

    async def close(self) -> None:
        for task in [*self._tasks.values(), *self._background]:
            task.cancel()
        await asyncio.gather(*self._tasks.values(), *self._background, return_exceptions=True)
        await asyncio.gather(*(replica.client.close() for replica in self._replicas.values()))

    def _client(self, address: str) -> InferenceClient:
        return InferenceClient(address, slow_readers=self._config.slow_readers,
                               stream_interval=self._config.stream_interval)

    def _add(self, address: str, client: InferenceClient) -> Replica:
        replica = Replica(address, client)
        watcher = ReplicaWatcher(replica, self._events_index, block_layout=self._layout,
                                 heartbeat_interval_ms=self._config.heartbeat_interval_ms)
        self._replicas[address] = replica
        task = self._tasks[address] = asyncio.get_running_loop().create_task(watcher.run())
        task.add_done_callback(_log_if_crashed)
        return replica

    async def _wait_until_heard(self, replicas: Sequence[Replica]) -> None:
        try:
            async with asyncio.timeout(FIRST_HEARTBEAT_TIMEOUT_S):
                await asyncio.gather(*(replica.has_been_heard.wait() for replica in replicas))
        except TimeoutError:
            silent = [replica.address for replica in replicas if not replica.has_been_heard.is_set()]
            log.warning("no heartbeat yet from inference at %s; serving without it", ", ".join(silent))

    async def _follow_discovery(self, current: frozenset[str]) -> None:
        async for addresses in self._addresses.changes(current):
            for address in sorted(addresses - self._replicas.keys() - self._refused):
                self._spawn(self._join(address))
            for address in sorted(self._replicas.keys() - addresses):
                self._leave(address)
            self._refused &= addresses

    async def _join(self, address: str) -> None:
        client = self._client(address)
        try:
            await client.wait_until_serving(self._config.downstream_ready_timeout_s)
            card = await client.get_model_card()
            check_block_layouts(self._layout, {address: card.block_layout})
        except (ServiceError, BlockLayoutMismatch) as error:
            log.error("inference at %s not added: %s", address, getattr(error, "message", error))
            self._refused.add(address)
            await client.close()
            return
        log.info("inference at %s joined", address)
        self._add(address, client)

    def _leave(self, address: str) -> None:
        replica = self._replicas.pop(address)
        self._tasks.pop(address).cancel()
        replica.is_live = False
        log.info("inference at %s left (no longer in DNS)", address)
        self._spawn(self._retire(replica))

    async def _retire(self, replica: Replica) -> None:
        if self._events_index is not None and replica.replica_id is not None:
            await self._events_index.remove_replica(replica.replica_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_TIMEOUT_S
        while replica.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        await replica.client.close()

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)  # kept so it is not garbage-collected mid-flight
        task.add_done_callback(self._background.discard)


def _log_if_crashed(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a replica watcher crashed; its replica keeps its last state", exc_info=task.exception())

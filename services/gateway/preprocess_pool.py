"""The gateway's client for several preprocess replicas: least in flight, health-aware.

Preprocess is stateless, so any replica can take any request, and a request refused as
UNAVAILABLE (the replica is down, draining, or its connection broke: a replica killed mid-call)
is sent once more, to another replica, within the time left on its deadline. One retry, not one
per replica: when the whole tier is failing, a retry per replica would multiply the load on it
by its size. Each call goes to the replica with the fewest calls in flight, ties taken in turn. A
replica whose call fails UNAVAILABLE, or whose health check does not answer SERVING, is skipped
for `retry_after_s`; after that it gets calls again (and a health check that answers SERVING
brings it back at once). When every replica is skipped, the one skipped longest is tried anyway,
so that a pool whose replicas all came back is not refused for a stale view.

Addresses come from a callable, read before each pick, so discovery (a DNS name resolved to
pod IPs, a watch on endpoints) plugs in without the pool knowing how: a replica that appears
gets a client, one that disappears is closed once its calls finish. The pool runs on the event
loop of its gateway process and takes no lock: one address costs a tuple comparison per call
over a bare PreprocessClient.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from llmserve.errors import Unavailable
from llmserve.gateway.preprocess_client import PreparedPrompt, PreprocessClient, PromptInput

DEFAULT_RETRY_AFTER_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 1.0  # a replica not SERVING within this is skipped
MAX_ATTEMPTS = 2  # a call refused UNAVAILABLE is retried once, on another replica


@dataclass(slots=True)
class ReplicaStatus:
    """One replica as the pool sees it (for logs and health reports)."""

    address: str
    is_up: bool
    num_in_flight: int
    num_calls: int  # calls sent to it so far, failed ones included


class _Replica:
    def __init__(self, address: str):
        self.client = PreprocessClient(address)
        self.num_in_flight = 0
        self.num_calls = 0
        self.skipped_until_s = 0.0  # monotonic; skipped while in the future

    def is_up(self, now_s: float) -> bool:
        return self.skipped_until_s <= now_s


class PreprocessPool:
    """`preprocess` like PreprocessClient's, over the replicas `addresses()` names."""

    def __init__(self, addresses: Callable[[], Sequence[str]], *, retry_after_s: float = DEFAULT_RETRY_AFTER_S):
        self._addresses = addresses
        self._retry_after_s = retry_after_s
        self._replicas: dict[str, _Replica] = {}
        self._synced: tuple[str, ...] = ()  # what addresses() said at the last sync
        self._retired: list[_Replica] = []  # gone from discovery, closed once idle
        self._turn = itertools.count()

    async def preprocess(
        self, request_id: str, prompt_input: PromptInput, *, max_tokens: int | None, cache_salt: str,
        timeout_s: float | None,
    ) -> PreparedPrompt:
        """As PreprocessClient.preprocess, on the least busy replica that is up; a call refused
        UNAVAILABLE skips its replica and is sent once more to another, in the time left."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        tried: set[str] = set()
        while True:
            replica = self._pick(tried)
            tried.add(replica.client.address)
            replica.num_in_flight += 1
            replica.num_calls += 1
            try:
                return await replica.client.preprocess(
                    request_id, prompt_input, max_tokens=max_tokens, cache_salt=cache_salt,
                    timeout_s=None if deadline_s is None else deadline_s - time.monotonic(),
                )
            except Unavailable:
                self._skip(replica)
                if not self._can_retry(tried, deadline_s):
                    raise
            finally:
                replica.num_in_flight -= 1
                if self._retired:
                    await self._close_retired()

    async def check_health(self) -> None:
        """Ask every replica's grpc.health.v1 once: SERVING → up now, anything else → skipped."""
        self._sync()
        replicas = list(self._replicas.values())
        statuses = await asyncio.gather(*(self._is_serving(r) for r in replicas))
        for replica, is_serving in zip(replicas, statuses, strict=True):
            if is_serving:
                replica.skipped_until_s = 0.0
            else:
                self._skip(replica)

    async def run_health_checks(self, interval_s: float) -> None:
        """`check_health` every `interval_s` until cancelled (a task the gateway owns)."""
        while True:
            await self.check_health()
            await asyncio.sleep(interval_s)

    def status(self) -> list[ReplicaStatus]:
        now_s = time.monotonic()
        return [
            ReplicaStatus(address, replica.is_up(now_s), replica.num_in_flight, replica.num_calls)
            for address, replica in self._replicas.items()
        ]

    async def close(self) -> None:
        for replica in [*self._replicas.values(), *self._retired]:
            await replica.client.close()
        self._replicas.clear()
        self._retired.clear()

    def _pick(self, tried: set[str]) -> _Replica:
        self._sync()
        if len(self._replicas) == 1 and not tried:  # the one replica is called, up or not: skip the choosing
            return next(iter(self._replicas.values()))
        candidates = [r for address, r in self._replicas.items() if address not in tried]
        if not candidates:
            raise Unavailable("no preprocess replica to send the request to")
        now_s = time.monotonic()
        up = [r for r in candidates if r.is_up(now_s)]
        if not up:  # all skipped: probe the one skipped longest rather than refuse
            return min(candidates, key=lambda r: r.skipped_until_s)
        turn = next(self._turn)
        rotated = up[turn % len(up) :] + up[: turn % len(up)]
        return min(rotated, key=lambda r: r.num_in_flight)

    def _can_retry(self, tried: set[str], deadline_s: float | None) -> bool:
        has_time = deadline_s is None or deadline_s > time.monotonic()
        return has_time and len(tried) < min(MAX_ATTEMPTS, len(self._replicas))

    def _skip(self, replica: _Replica) -> None:
        replica.skipped_until_s = time.monotonic() + self._retry_after_s

    def _sync(self) -> None:
        """Follow `addresses()`: clients for new replicas, retire the ones no longer named."""
        addresses = tuple(self._addresses())
        if addresses == self._synced:
            return
        self._synced = addresses
        for address in addresses:
            if address not in self._replicas:
                self._replicas[address] = _Replica(address)
        for address in [a for a in self._replicas if a not in addresses]:
            self._retired.append(self._replicas.pop(address))

    async def _close_retired(self) -> None:
        idle = [r for r in self._retired if r.num_in_flight == 0]
        self._retired = [r for r in self._retired if r.num_in_flight > 0]
        for replica in idle:
            await replica.client.close()

    @staticmethod
    async def _is_serving(replica: _Replica) -> bool:
        try:
            await replica.client.wait_until_serving(HEALTH_CHECK_TIMEOUT_S)
        except Unavailable:
            return False
        return True

"""The gateway's client for several preprocess servers: least in flight, health-aware.

Preprocess is stateless, so any server can take any request, and a request refused as
UNAVAILABLE (the server is down, draining, or its connection broke: a server killed mid-call)
is sent once more, to another server, within the time left on its deadline. One retry, not one
per server: when the whole tier is failing, a retry per server would multiply the load on it
by its size. Each call goes to the server with the fewest calls in flight, ties taken in turn. A
server whose call fails UNAVAILABLE, or whose health check does not answer SERVING, is skipped
for `retry_after_s`; after that it gets calls again (and a health check that answers SERVING
brings it back at once). When every server is skipped, the one skipped longest is tried anyway,
so that a pool whose servers all came back is not refused for a stale view.

Addresses come from a callable, read before each pick, so discovery (a DNS name resolved to
pod IPs, a watch on endpoints) plugs in without the pool knowing how: a server that appears
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
from llmserve.gateway.preprocess_client import PreparedPrompt, PreprocessClient
from llmserve.prompt_input import PromptInput

DEFAULT_RETRY_AFTER_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 1.0  # a server not SERVING within this is skipped
MAX_ATTEMPTS = 2  # a call refused UNAVAILABLE is retried once, on another server


@dataclass(slots=True)
class ServerStatus:
    """One server as the pool sees it (for logs and health reports)."""

    address: str
    is_up: bool
    num_in_flight: int
    num_calls: int  # calls sent to it so far, failed ones included


class _Server:
    def __init__(self, address: str):
        self.client = PreprocessClient(address)
        self.num_in_flight = 0
        self.num_calls = 0
        self.skipped_until_s = 0.0  # monotonic; skipped while in the future

    def is_up(self, now_s: float) -> bool:
        return self.skipped_until_s <= now_s


class PreprocessPool:
    """`preprocess` like PreprocessClient's, over the servers `addresses()` names."""

    def __init__(self, addresses: Callable[[], Sequence[str]], *, retry_after_s: float = DEFAULT_RETRY_AFTER_S,
                 ids_in_region_from: Callable[[str], int] = lambda address: 0):
        self._addresses = addresses
        # Per server: the least prompt tokens whose ids it answers in its shared-memory ring
        # (0: none; only a server whose ring this gateway can map: preprocess_servers.py).
        self._ids_in_region_from = ids_in_region_from
        self._retry_after_s = retry_after_s
        self._servers: dict[str, _Server] = {}
        self._synced: tuple[str, ...] = ()  # what addresses() said at the last sync
        self._retired: list[_Server] = []  # gone from discovery, closed once idle
        self._turn = itertools.count()

    async def preprocess(
        self, request_id: str, prompt_input: PromptInput, *, max_tokens: int | None, cache_salt: str,
        timeout_s: float | None,
    ) -> PreparedPrompt:
        """As PreprocessClient.preprocess, on the least busy server that is up; a call refused
        UNAVAILABLE skips its server and is sent once more to another, in the time left."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        tried: set[str] = set()
        while True:
            server = self._pick(tried)
            tried.add(server.client.address)
            server.num_in_flight += 1
            server.num_calls += 1
            try:
                return await server.client.preprocess(
                    request_id, prompt_input, max_tokens=max_tokens, cache_salt=cache_salt,
                    timeout_s=None if deadline_s is None else deadline_s - time.monotonic(),
                    ids_in_region_from=self._ids_in_region_from(server.client.address),
                )
            except Unavailable:
                self._skip(server)
                if not self._can_retry(tried, deadline_s):
                    raise
            finally:
                server.num_in_flight -= 1
                if self._retired:
                    await self._close_retired()

    async def check_health(self) -> None:
        """Ask every server's grpc.health.v1 once: SERVING → up now, anything else → skipped."""
        self._sync()
        servers = list(self._servers.values())
        statuses = await asyncio.gather(*(self._is_serving(r) for r in servers))
        for server, is_serving in zip(servers, statuses, strict=True):
            if is_serving:
                server.skipped_until_s = 0.0
            else:
                self._skip(server)

    async def run_health_checks(self, interval_s: float) -> None:
        """`check_health` every `interval_s` until cancelled (a task the gateway owns)."""
        while True:
            await self.check_health()
            await asyncio.sleep(interval_s)

    def status(self) -> list[ServerStatus]:
        now_s = time.monotonic()
        return [
            ServerStatus(address, server.is_up(now_s), server.num_in_flight, server.num_calls)
            for address, server in self._servers.items()
        ]

    async def close(self) -> None:
        for server in [*self._servers.values(), *self._retired]:
            await server.client.close()
        self._servers.clear()
        self._retired.clear()

    def _pick(self, tried: set[str]) -> _Server:
        self._sync()
        if len(self._servers) == 1 and not tried:  # the one server is called, up or not: skip the choosing
            return next(iter(self._servers.values()))
        candidates = [r for address, r in self._servers.items() if address not in tried]
        if not candidates:
            raise Unavailable("no preprocess server to send the request to")
        now_s = time.monotonic()
        up = [r for r in candidates if r.is_up(now_s)]
        if not up:  # all skipped: probe the one skipped longest rather than refuse
            return min(candidates, key=lambda r: r.skipped_until_s)
        turn = next(self._turn)
        rotated = up[turn % len(up) :] + up[: turn % len(up)]
        return min(rotated, key=lambda r: r.num_in_flight)

    def _can_retry(self, tried: set[str], deadline_s: float | None) -> bool:
        has_time = deadline_s is None or deadline_s > time.monotonic()
        return has_time and len(tried) < min(MAX_ATTEMPTS, len(self._servers))

    def _skip(self, server: _Server) -> None:
        server.skipped_until_s = time.monotonic() + self._retry_after_s

    def _sync(self) -> None:
        """Follow `addresses()`: clients for new servers, retire the ones no longer named."""
        addresses = tuple(self._addresses())
        if addresses == self._synced:
            return
        self._synced = addresses
        for address in addresses:
            if address not in self._servers:
                self._servers[address] = _Server(address)
        for address in [a for a in self._servers if a not in addresses]:
            self._retired.append(self._servers.pop(address))

    async def _close_retired(self) -> None:
        idle = [r for r in self._retired if r.num_in_flight == 0]
        self._retired = [r for r in self._retired if r.num_in_flight > 0]
        for server in idle:
            await server.client.close()

    @staticmethod
    async def _is_serving(server: _Server) -> bool:
        try:
            await server.client.wait_until_serving(HEALTH_CHECK_TIMEOUT_S)
        except Unavailable:
            return False
        return True

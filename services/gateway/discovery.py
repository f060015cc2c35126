"""Finding the replicas of a service: static addresses and DNS names with many addresses.

A target is either
  - `host:port`: one replica (gRPC resolves the host itself), or
  - `dns:///name:port`: every address `name` resolves to is a replica (gRPC's naming syntax;
    a Kubernetes headless Service resolves to one address per ready pod). It is resolved again
    every `interval_s`, so pods that come and go join and leave.
A DNS failure keeps the addresses the name had last (a resolver hiccup must not empty the
fleet). Nothing here knows what service it finds: preprocess servers can be found the same way.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
DEFAULT_RESOLVE_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    is_dns: bool

    @classmethod
    def parse(cls, text: str) -> "Target":
        """`host:port` or `dns:///name:port`; ValueError naming the problem otherwise."""
        is_dns = text.startswith(DNS_SCHEME)
        address = text[len(DNS_SCHEME):] if is_dns else text
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r} is not host:port or {DNS_SCHEME}name:port")
        return cls(host.strip("[]"), int(port), is_dns)

    def __str__(self) -> str:
        return f"{DNS_SCHEME if self.is_dns else ''}{join_host_port(self.host, self.port)}"


def join_host_port(host: str, port: int) -> str:
    try:
        is_ipv6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_ipv6 = False
    return f"[{host}]:{port}" if is_ipv6 else f"{host}:{port}"


async def resolve(target: Target) -> frozenset[str]:
    """The `host:port` addresses of a target's replicas (raises OSError when DNS fails)."""
    if not target.is_dns:
        return frozenset({join_host_port(target.host, target.port)})
    infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    return frozenset(join_host_port(info[4][0], target.port) for info in infos)


class AddressWatcher:
    """The union of every target's addresses, as it changes."""

    def __init__(self, targets: Sequence[Target], interval_s: float = DEFAULT_RESOLVE_INTERVAL_S):
        self._targets = tuple(targets)
        self._interval_s = interval_s
        self._last: dict[Target, frozenset[str]] = {}

    @property
    def is_static(self) -> bool:
        """No DNS target: the addresses never change."""
        return not any(target.is_dns for target in self._targets)

    async def resolve(self) -> frozenset[str]:
        """Every target resolved now (a failing one keeps its last addresses, if any)."""
        for target in self._targets:
            try:
                self._last[target] = await resolve(target)
            except OSError as error:
                log.warning("cannot resolve %s (%s); keeping its last %d addresses",
                            target, error, len(self._last.get(target, ())))
        return frozenset().union(*self._last.values())

    async def resolve_some(self, timeout_s: float) -> frozenset[str]:
        """Addresses as soon as the targets name any, resolving every interval for up to
        `timeout_s` (empty after that): a headless Service lists no pod until one is ready, and
        a gateway started beside its replicas must wait for them, not exit."""
        deadline = time.monotonic() + timeout_s
        while not (addresses := await self.resolve()):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            log.info("no address for %s yet; resolving again", ", ".join(map(str, self._targets)))
            await asyncio.sleep(min(self._interval_s, left_s))
        return addresses

    async def changes(self, current: frozenset[str]) -> AsyncIterator[frozenset[str]]:
        """Each new set of addresses after `current`, checked every interval; forever."""
        while True:
            await asyncio.sleep(self._interval_s)
            addresses = await self.resolve()
            if addresses != current:
                current = addresses
                yield addresses

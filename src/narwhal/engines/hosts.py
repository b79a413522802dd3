"""Does a host name mean the same machine as another? Answered from DNS, cached briefly."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable

RESOLVE_TTL_S = 60.0


def normalize(host: str) -> str:
    """Lower-case, IPv6 brackets removed, IP literals in canonical form."""
    bare = host.strip().lower().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return bare


class HostResolver:
    """Resolves names to address sets, caching each answer for `ttl_s` (failures too)."""

    def __init__(self, ttl_s: float = RESOLVE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}
        self._answers: dict[tuple[str, tuple[str, ...]], tuple[float, bool]] = {}

    async def addresses(self, host: str) -> frozenset[str]:
        name = normalize(host)
        try:
            return frozenset({str(ipaddress.ip_address(name))})
        except ValueError:
            pass
        loop = asyncio.get_running_loop()
        cached = self._cache.get(name)
        if cached is not None and cached[0] > loop.time():
            return cached[1]
        try:
            infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            found = frozenset(normalize(str(info[4][0])) for info in infos)
        except OSError:
            found = frozenset()
        self._cache[name] = (loop.time() + self.ttl_s, found)
        return found

    async def same_machine(self, host: str, allowed: Iterable[str]) -> bool:
        """True when `host` is one of `allowed`, by name or by a shared address.

        Answers are cached like the addresses behind them: a fleet asks the same question
        for every request.
        """
        key = (host, tuple(allowed))
        loop = asyncio.get_running_loop()
        cached = self._answers.get(key)
        if cached is not None and cached[0] > loop.time():
            return cached[1]
        answer = await self._same_machine(host, key[1])
        self._answers[key] = (loop.time() + self.ttl_s, answer)
        return answer

    async def _same_machine(self, host: str, allowed: tuple[str, ...]) -> bool:
        wanted = {normalize(a) for a in allowed}
        if normalize(host) in wanted:
            return True
        mine = await self.addresses(host)
        for other in wanted:
            if mine & await self.addresses(other):
                return True
        return False

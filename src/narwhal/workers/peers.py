"""Reaching every worker of the router over its Unix socket in the run directory."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from narwhal.workers.status import peer_socket


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    """One worker's answer: its status and body."""

    status: int
    body: bytes


class Peers:
    """The workers of one router (this one, `me`, included), asked all at once."""

    def __init__(self, run_dir: Path, count: int, me: int, timeout_s: float = 5.0) -> None:
        self.run_dir = run_dir
        self.count = count
        self.me = me
        self.timeout_s = timeout_s
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    async def ask(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        others_only: bool = False,
    ) -> dict[int, PeerAnswer | None]:
        """Each worker's answer, by number; None for one that could not be reached (it is
        starting or has just died)."""
        workers = [w for w in range(self.count) if not (others_only and w == self.me)]
        answers = await asyncio.gather(
            *(self._ask_one(w, method, path, body, headers or {}) for w in workers)
        )
        return dict(zip(workers, answers, strict=True))

    async def _ask_one(
        self, worker: int, method: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> PeerAnswer | None:
        session = self._session(worker)
        try:
            async with session.request(
                method, "http://worker" + path, data=body or None, headers=dict(headers)
            ) as response:
                return PeerAnswer(response.status, await response.read())
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    def _session(self, worker: int) -> aiohttp.ClientSession:
        session = self._sessions.get(worker)
        if session is None:
            # A fresh connection each time: a worker replaced since the last ask is reached anew.
            connector = aiohttp.UnixConnector(
                path=str(peer_socket(self.run_dir, worker)), force_close=True
            )
            session = self._sessions[worker] = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return session

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

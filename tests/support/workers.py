"""A real `narwhal serve --workers N` process over in-process simulated engines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from narwhal.tools.sim.fleet import SimFleet
from support.stack import serve_process

MODEL = "narwhal-sim"


@dataclass
class Served:
    """The supervisor process, its address and its journal."""

    process: asyncio.subprocess.Process
    url: str
    journal_path: Path

    async def state(self) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.url + "/narwhal/state") as response,
        ):
            assert response.status == 200, await response.text()
            state: dict[str, Any] = await response.json()
            return state

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/metrics") as response:
            return await response.text()

    def journal(self) -> list[dict[str, Any]]:
        """Every complete line; each must be a whole JSON object (no torn lines)."""
        if not self.journal_path.exists():
            return []
        return [orjson.loads(line) for line in self.journal_path.read_bytes().split(b"\n")[:-1]]

    async def journal_lines(self, expect: int, kind: str = "request") -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = []
        for _ in range(300):
            lines = [line for line in self.journal() if line["type"] == kind]
            if len(lines) >= expect:
                break
            await asyncio.sleep(0.02)
        return lines


def fleet_toml(
    fleet: SimFleet,
    roles: Sequence[tuple[str, str]],
    journal: Path,
    extra: str = "",
    engine_keys: str = "",
) -> str:
    """A config file for `fleet`: `extra` goes before the engines, `engine_keys` in each."""
    engines = "".join(
        f'[[engines]]\nid = "{name}"\nurl = "{engine.url}"\nrole = "{role}"\n'
        f'identity_url = "{engine.url}/sim/identity"\n{engine_keys}'
        for (name, role), engine in zip(roles, fleet.engines, strict=True)
    )
    return f'model = "{MODEL}"\n{extra}\n[journal]\npath = "{journal}"\n{engines}'


@contextlib.asynccontextmanager
async def serve_workers(
    tmp_path: Path, config_text: str, workers: int, journal: Path
) -> AsyncIterator[Served]:
    """`narwhal serve --workers N` until its banner; stopped with SIGTERM at the end (a test
    that stops it itself waits for it itself). Its stderr goes to `serve.log`."""
    path = tmp_path / "fleet.toml"
    path.write_text(config_text)
    args = ("--workers", str(workers), "--skip-preflight")
    async with serve_process(path, tmp_path / "serve.log", wait_s=60, args=args) as (
        process,
        url,
    ):
        yield Served(process, url, journal)


async def post_fresh(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """A request on a connection of its own (so the kernel picks a worker for each);
    status 0 when the connection broke."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        try:
            async with http.post(url + "/v1/completions", json=body) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, ConnectionError):
            return 0, b""

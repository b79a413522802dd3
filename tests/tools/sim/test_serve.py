"""`narwhal sim` as a process, and several engines in one process with SimFleet."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import aiohttp
import pytest

from narwhal.tools.sim.fleet import SimFleet
from narwhal.tools.sim.options import SimOptions
from narwhal.tools.sim.serve import CRASH_EXIT_CODE

if TYPE_CHECKING:
    from tools.sim.conftest import Sim

LISTENING = re.compile(rb"narwhal sim (\S+) listening on (http://\S+) \(side channel (\S+)\)")


@asynccontextmanager
async def _narwhal_sim(*flags: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """Run `narwhal sim` on a free port; yields the process and its URL."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "narwhal", "sim", "--port", "0", "--id", "s0", *flags,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        async with asyncio.timeout(10):
            line = await process.stdout.readline()
        match = LISTENING.match(line)
        assert match is not None, line
        assert match.group(1) == b"s0"
        yield process, match.group(2).decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_narwhal_sim_serves_and_stops_cleanly_on_sigterm() -> None:
    async with _narwhal_sim("--inter-token-s", "0") as (process, url):
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "hello", "max_tokens": 3}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await process.wait() == 0


async def test_crash_fault_exits_the_process_with_a_failure_status() -> None:
    async with _narwhal_sim("--fault", '{"phase": "decode", "crash": true}') as (process, url):
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                await session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        async with asyncio.timeout(10):
            assert await process.wait() == CRASH_EXIT_CODE


async def test_fleet_starts_several_engines_in_one_process_and_stops_them(sim: Sim) -> None:
    options = [SimOptions(name=name) for name in ("p0", "d0", "d1")]
    async with SimFleet(options) as fleet:
        assert [engine.options.name for engine in fleet] == ["p0", "d0", "d1"]
        assert len({engine.url for engine in fleet}) == 3
        assert len({engine.engine_id for engine in fleet}) == 3
        for engine in fleet:
            assert (await sim.get(engine, "/health"))[0] == 200
    with pytest.raises(aiohttp.ClientConnectorError):
        await sim.get(fleet[0], "/health")

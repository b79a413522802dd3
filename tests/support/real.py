"""Support for tests/real: a real router in front of real vLLM engines on the CPU.

`make real` installs `.venv-vllm` and builds the tiny model before these tests run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from narwhal.app.server import RouterServer
from narwhal.tools.vllm_fleet import VllmEngine, VllmFleet

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # not resolved: a venv's python is a link
TINY_MODEL = ROOT / ".cache" / "tiny-model"
MODEL = "narwhal-tiny"
# The tiny model's builder gives chat a DeepSeek-R1 style thought, read by this parser.
REASONING_PARSER = "deepseek_r1"
# Engines on a busy 2-core machine: generous client timeouts everywhere.
CLIENT_TIMEOUT_S = 120.0
# The engines' KV lease, short so that a test leaving a handoff unpulled waits little (vLLM
# 0.32 on the CPU was seen to stall a producer's next transfers until such blocks expire),
# yet long enough that a prefill slowed by a busy machine still hands over: the router's
# bound is five sixths of it, and prefills of several seconds were seen under load.
KV_LEASE_S = 20
# `make real-continuation`: a second consumer and continuation on, for the test that kills
# a consumer mid-answer. Left out of `make real`: on a shared CPU its kills and lease-long
# stalls unsettle the tests that follow.
CONTINUATION = os.environ.get("NARWHAL_REAL_CONTINUATION") == "1"
# Measurements worth a line in the session's terminal summary, by name.
FIGURES: dict[str, str] = {}


@dataclass
class RealStack:
    """A prefill and a decode vLLM engine and a router over them, for the whole session."""

    fleet: VllmFleet
    server: RouterServer
    journal_path: Path
    # A second router over the same engines, with `engine.nonstream_decode = "whole"`.
    whole: RouterServer | None = None
    whole_journal_path: Path | None = None

    @property
    def producer(self) -> VllmEngine:
        return self.fleet["p0"]

    @property
    def consumer(self) -> VllmEngine:
        return self.fleet["d0"]

    def openai(self) -> AsyncOpenAI:
        """The official client, pointed at the router."""
        return _client(self.server.url)

    def whole_openai(self) -> AsyncOpenAI:
        """The official client, pointed at the router that asks for whole answers."""
        assert self.whole is not None
        return _client(self.whole.url)

    def direct(self, engine: VllmEngine) -> AsyncOpenAI:
        """The official client, pointed at one engine alone (no handoff)."""
        return _client(engine.url)

    async def wait_out_lease(self) -> None:
        """After a handoff left unpulled (a refused or unsent decode): until its blocks are
        freed, so that the next test's transfers do not wait for them."""
        await asyncio.sleep(KV_LEASE_S + 1)

    async def journal_entry(self, client_request_id: str) -> dict[str, Any]:
        """The router's journal line for the request sent with this X-Request-Id (the
        journal is written by a thread, so the line may land a moment after the answer)."""
        for _ in range(100):
            for line in self.journal_path.read_text().splitlines():
                entry: dict[str, Any] = json.loads(line)
                if entry.get("client_request_id") == client_request_id:
                    return entry
            await asyncio.sleep(0.1)
        raise AssertionError(f"no journal line for request {client_request_id}")

    async def engine_state(self, name: str) -> str:
        """The router's view of one engine: admitted, quarantined, ejected or held."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.server.url + "/narwhal/state") as response,
        ):
            state = await response.json()
        return str(next(e["state"] for e in state["engines"] if e["id"] == name))


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


async def counter(engine: VllmEngine, name: str, **labels: str) -> float:
    """One series of an engine's /metrics (0 when absent), e.g. a per-source prompt count."""
    async with aiohttp.ClientSession() as http, http.get(engine.url + "/metrics") as response:
        text = await response.text()
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(key) == value for key, value in labels.items()):
            total += float(match.group(2))
    return total

"""The `sim` fixture: engines started for one test (fast timings), and HTTP calls to them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson
import pytest

from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.options import SimOptions

FAST = SimOptions(
    inter_token_s=0.0,
    prefill_s_per_token=0.0,
    request_overhead_s=0.0,
    kv_pull_s_per_block=0.0,
    slowdown_per_seq=0.0,
)
"""Options without timing costs; tests add back the costs they look at."""


@dataclass
class Stream:
    """A read SSE response: its JSON events, its comments (keep-alives), whether [DONE]
    came, whether the body broke."""

    status: int
    events: list[dict[str, Any]] = field(default_factory=list)
    comments: list[bytes] = field(default_factory=list)
    done: bool = False
    after_done: bytes = b""
    broken: bool = False

    @property
    def text(self) -> str:
        """The generated text of a completions or chat stream."""
        return "".join(_output(choice) for event in self.events for choice in event["choices"])

    @property
    def output_events(self) -> list[dict[str, Any]]:
        """Events carrying generated output (not role, metadata, usage or error events)."""
        return [
            event
            for event in self.events
            if any(_output(choice) for choice in event.get("choices", []))
        ]


def _output(choice: dict[str, Any]) -> str:
    text: str = choice.get("text") or choice.get("delta", {}).get("content") or ""
    return text


class Sim:
    """Starts engines from FAST options (stopped after the test) and calls them over HTTP."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.engines: list[SimEngine] = []

    async def start(self, **overrides: Any) -> SimEngine:
        engine = SimEngine(replace(FAST, **overrides))
        self.engines.append(engine)
        await engine.start()
        return engine

    async def post(
        self,
        engine: SimEngine,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """A non-streaming call: its status and JSON body."""
        async with self.session.post(engine.url + path, json=body, headers=headers) as response:
            return response.status, orjson.loads(await response.read())

    async def stream(
        self,
        engine: SimEngine,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> Stream:
        """A streaming call read to its end (or to where the connection broke)."""
        body = body | {"stream": True}
        async with self.session.post(engine.url + path, json=body, headers=headers) as response:
            stream = Stream(response.status)
            raw = b""
            try:
                async for data in response.content.iter_any():
                    raw += data
            except aiohttp.ClientPayloadError:
                stream.broken = True
        for chunk in raw.split(b"\n\n"):
            if stream.done:
                stream.after_done += chunk
            elif chunk == b"data: [DONE]":
                stream.done = True
            elif chunk.startswith(b":"):
                stream.comments.append(chunk)
            elif chunk:
                assert chunk.startswith(b"data: "), chunk
                stream.events.append(orjson.loads(chunk.removeprefix(b"data: ")))
        return stream

    @staticmethod
    async def until(condition: Callable[[], bool]) -> None:
        """Wait until an engine counter reaches a state (counters have no events to await)."""
        async with asyncio.timeout(2.0):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.002)

    async def get(self, engine: SimEngine, path: str) -> tuple[int, bytes]:
        async with self.session.get(engine.url + path) as response:
            return response.status, await response.read()


@pytest.fixture
async def sim() -> AsyncIterator[Sim]:
    async with aiohttp.ClientSession() as session:
        helper = Sim(session)
        try:
            yield helper
        finally:
            for engine in helper.engines:
                await engine.stop()

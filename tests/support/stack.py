"""Shared test support: a real router over real sockets in front of in-process simulated engines."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import orjson
from openai import AsyncOpenAI

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.config.secrets import Secrets
from narwhal.observe.tracing import Tracing
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.faults import Fault
from narwhal.tools.sim.fleet import SimFleet
from narwhal.tools.sim.options import SimOptions

MODEL = "narwhal-sim"
# Quick engines: tests wait on faults, not on simulated compute.
FAST = SimOptions(
    faults_enabled=True,
    prefill_s_per_token=0.0,
    request_overhead_s=0.0,
    inter_token_s=0.001,
    kv_pull_s_per_block=0.0,
    slowdown_per_seq=0.0,
)
CROSSED = (("p0", "prefill"), ("d0", "decode"))
# The two client-facing servers a request may meet: the fast lane (`http.front`) serves the
# usual request; a request with a content coding, even `identity`, goes to aiohttp.
LANES = ("fast", "aiohttp")
_OFF_LANE = {"Content-Encoding": "identity"}
# How long the router may take to settle and to write its journal after the last request:
# milliseconds on an idle machine, seconds on a busy one.
SETTLE_WITHIN_S = 20.0


def lane_of(server_header: str | None) -> str:
    """Which server answered: aiohttp names itself in `Server`, the fast lane does not."""
    return "aiohttp" if "aiohttp" in (server_header or "") else "fast"


@dataclass
class Stack:
    """One fleet plus one router; `engine(name)` reaches a simulated engine directly.

    Its clients (`openai()`, `http`, `post`) reach the router's `lane`, and note in `lanes`
    which server answered each of their requests to the router."""

    fleet: SimFleet
    server: RouterServer
    journal_path: Path
    http: aiohttp.ClientSession
    lane: str = "fast"
    lanes: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    def engine(self, name: str) -> SimEngine:
        return next(e for e in self.fleet.engines if e.options.name == name)

    def openai(self, **kwargs: Any) -> AsyncOpenAI:
        headers = {
            **(_OFF_LANE if self.lane == "aiohttp" else {}),
            **kwargs.pop("default_headers", {}),
        }

        async def note(response: httpx2.Response) -> None:
            self.lanes.append(lane_of(response.headers.get("server")))

        client = httpx2.AsyncClient(event_hooks={"response": [note]})
        return AsyncOpenAI(
            base_url=self.url + "/v1",
            api_key="unused",
            max_retries=0,
            default_headers=headers,
            http_client=client,
            **kwargs,
        )

    async def journal(self, expect: int = 1, kind: str | None = None) -> list[dict[str, Any]]:
        """The journal's lines (of `type` `kind`, or all) once there are at least `expect`.

        It is written off the loop, so lines appear a little after the request ends.
        """
        lines: list[dict[str, Any]] = []
        deadline = time.monotonic() + SETTLE_WITHIN_S
        while time.monotonic() < deadline:
            if self.journal_path.exists():
                # The writer may be mid-line: only lines it has ended are read.
                complete = self.journal_path.read_bytes().split(b"\n")[:-1]
                lines = [orjson.loads(line) for line in complete]
                lines = [line for line in lines if kind is None or line["type"] == kind]
                if len(lines) >= expect:
                    break
            await asyncio.sleep(0.01)
        return lines

    async def post(self, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST to the router and return (status, parsed JSON or raw SSE text)."""
        return await self._post(self.url + route, body)

    async def post_to_engine(self, name: str, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST to one engine directly, without the router: what vLLM alone answers."""
        return await self._post(self.engine(name).url + route, body)

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(url, json=body) as response:
            raw = await response.read()
            if response.content_type == "application/json":
                return response.status, orjson.loads(raw)
            return response.status, raw.decode()


StackFactory = Callable[..., AbstractAsyncContextManager[Stack]]


def stack_factory(tmp_path: Path, lane: str = "fast") -> StackFactory:
    """`async with make_stack(roles, engine={...}, sim={...}) as stack:`; `lane`: which of
    the two client-facing servers the stack's clients reach (`LANES`)."""

    @asynccontextmanager
    async def factory(
        roles: Sequence[tuple[str, str]] = CROSSED,
        *,
        sim: dict[str, Any] | None = None,
        sim_by_engine: dict[str, dict[str, Any]] | None = None,
        engine_keys: dict[str, dict[str, Any]] | None = None,
        secrets: Secrets | None = None,
        tracer: Tracing | None = None,
        **sections: dict[str, Any],
    ) -> AsyncIterator[Stack]:
        """`sim` applies to every engine, `sim_by_engine` to one; `engine_keys` adds
        `[[engines]]` keys by engine id; `tracer` replaces the router's tracing. The
        clients reach the router's `lane` server; leaving checks that they all did."""
        options = [
            replace(FAST, name=name, **(sim or {}), **(sim_by_engine or {}).get(name, {}))
            for name, _ in roles
        ]
        journal_path = tmp_path / "journal.jsonl"
        async with SimFleet(options) as fleet:
            config = parse_config(
                {
                    "model": MODEL,
                    "journal": {"path": str(journal_path)},
                    **sections,
                    "engines": [
                        {
                            "id": name,
                            "url": engine.url,
                            "role": role,
                            "identity_url": engine.url + "/sim/identity",
                            **(engine_keys or {}).get(name, {}),
                        }
                        for (name, role), engine in zip(roles, fleet.engines, strict=True)
                    ],
                },
                source="test",
            )
            server = RouterServer(config, port=0, secrets=secrets, tracing=tracer)
            await server.start()
            lanes: list[str] = []

            async def note(
                session: aiohttp.ClientSession, context: Any, end: aiohttp.TraceRequestEndParams
            ) -> None:
                if end.url.port == server.port:
                    lanes.append(lane_of(end.response.headers.get("Server")))

            tracing = aiohttp.TraceConfig()
            tracing.on_request_end.append(note)
            headers = _OFF_LANE if lane == "aiohttp" else None
            try:
                async with aiohttp.ClientSession(headers=headers, trace_configs=[tracing]) as http:
                    stack = Stack(fleet, server, journal_path, http, lane, lanes)
                    yield stack
            finally:
                await server.stop()
            # Only requests to the two OpenAI routes may go the fast lane.
            assert lane == "fast" or set(lanes) <= {"aiohttp"}, lanes

    return factory


COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "The sea is deep and", "max_tokens": 8}
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about whales"}],
    "max_tokens": 9,
}


async def direct_text(engine_url: str, route: str, body: dict[str, Any]) -> str:
    """What one engine alone generates for `body` (non-streaming, no handoff)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(engine_url + route, json={**body, "stream": False}) as response,
    ):
        answer = await response.json()
    choice = answer["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def sse_payloads(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body, without the final [DONE]."""
    payloads = []
    for block in text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            payloads.append(orjson.loads(block[6:]))
    return payloads


def arm(engine: SimEngine, **fault: Any) -> None:
    """Arm a fault on an engine, exactly as `POST /sim/faults` would."""
    engine.set_fault(Fault.from_json(fault))


async def settled(stack: Stack) -> dict[str, Any]:
    """The router's state once nothing is in flight; asserts nothing leaked."""
    state: dict[str, Any] = {}
    deadline = time.monotonic() + SETTLE_WITHIN_S
    while time.monotonic() < deadline:
        async with stack.http.get(stack.url + "/narwhal/state") as response:
            state = await response.json()
        busy = any(e.running_count() for e in stack.fleet.engines)
        if not state["in_flight"] and not state["open_engine_legs"] and not busy:
            break
        await asyncio.sleep(0.01)
    assert state["in_flight"] == 0 and state["queued"] == 0
    assert state["open_engine_legs"] == 0
    for engine in state["engines"]:
        assert engine["seats"]["prefill"]["in_use"] == 0, engine
        assert engine["seats"]["decode"]["in_use"] == 0, engine
    assert all(e.running_count() == 0 for e in stack.fleet.engines)
    return state


def terminal_error(text: str) -> dict[str, Any]:
    """The error object that ends a committed stream (it must be the last event)."""
    payloads = sse_payloads(text)
    assert payloads and "error" in payloads[-1], text
    assert text.endswith("data: [DONE]\n\n")
    error: dict[str, Any] = payloads[-1]["error"]
    return error


CONTRACT: dict[str, Any] = {
    "engine_version": "0.11.0",
    "model": MODEL,
    "connector": "NixlConnector",
    "block_size": 16,
    "tp_size": 1,
}


async def router_state(stack: Stack) -> dict[str, Any]:
    async with stack.http.get(stack.url + "/narwhal/state") as response:
        state: dict[str, Any] = await response.json()
        return state


async def engine_state(
    stack: Stack, engine: str, want: str, timeout_s: float = 3.0
) -> dict[str, Any]:
    """The engine's entry in `/narwhal/state` once its state is `want` (or after the timeout)."""
    entry: dict[str, Any] = {}
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while loop.time() < until:
        state = await router_state(stack)
        entry = next(e for e in state["engines"] if e["id"] == engine)
        if entry["state"] == want:
            break
        await asyncio.sleep(0.02)
    return entry


def hold_readmission(stack: Stack) -> None:
    """Readmission judges no engine for the rest of the test, so that an ejection stays.

    (With a phase left without an admitted engine, readmission would probe at once.)
    """

    async def judge_nothing() -> None:
        return None

    stack.server.router.readmission.tick = judge_nothing  # type: ignore[method-assign]


@asynccontextmanager
async def serve_process(
    config: Path,
    log: Path,
    env: dict[str, str] | None = None,
    wait_s: float = 90.0,
    args: Sequence[str] = (),
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """`narwhal serve` (with `args`) as its own process on a free port: yields it and its URL.

    On the way out it is asked to stop with SIGTERM (killed if it will not), so the caller
    can assert on `returncode` after the block; stderr goes to `log`.
    """
    with log.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "narwhal", "serve", "--config", str(config)),
            *("--port", "0", *args),
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
            env=env,
        )
    try:
        assert process.stdout is not None
        banner = (await asyncio.wait_for(process.stdout.readline(), wait_s)).decode()
        assert "narwhal serving" in banner, log.read_text()  # noqa: ASYNC240 (a failure's report)
        yield process, banner.split(" on ")[1].split()[0]
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), wait_s)
        if process.returncode is None:
            process.kill()
            await process.wait()


@asynccontextmanager
async def peak_loads(engines: Sequence[SimEngine]) -> AsyncIterator[dict[SimEngine, int]]:
    """The most each engine itself ran plus queued at once while the block ran, sampled
    every 2 ms; the mapping is complete when the block has left."""
    peak = dict.fromkeys(engines, 0)
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            for engine in engines:
                peak[engine] = max(peak[engine], engine.running_count() + engine.waiting_count())
            await asyncio.sleep(0.002)

    watching = asyncio.create_task(watch())
    try:
        yield peak
    finally:
        done.set()
        await watching

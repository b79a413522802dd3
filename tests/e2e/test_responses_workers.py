"""Conversations kept where every router process reads them: `narwhal serve --workers 2`
over Redis and over the default SQLite file, two replicas over one Redis, and a Redis that
is down when the first Responses request comes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import openai
import orjson
import pytest
from openai import AsyncOpenAI
from openai.types.responses import Response

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.fleet import SimFleet
from support.redis_server import RedisServer, start_redis
from support.stack import CHAT, COMPLETION, FAST, MODEL, serve_process
from support.workers import Served, fleet_toml

ROLES = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
# At least this many turns; more (up to the most) until a follow-up has crossed from each
# worker to the other, which the kernel's choice of worker per connection makes likely
# within a few turns.
MIN_TURNS = 8
MAX_TURNS = 40
OUTPUT_TOKENS = 8
# A busy 2-core machine may take seconds where an idle one takes milliseconds, and a minute
# or more to start a router's worker processes: these are bounds, not expectations.
WAIT_S = 120.0
START_S = 300.0


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own."""
    directory = tmp_path / "redis"
    directory.mkdir()
    server = start_redis(directory)
    try:
        yield server
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def serve_two_workers(
    tmp_path: Path, config_text: str, journal: Path
) -> AsyncIterator[Served]:
    """`narwhal serve --workers 2` until its banner (its supervisor gives the workers a
    minute to start; this waits longer); stopped with SIGTERM at the end. Its stderr goes
    to `serve.log`."""
    path = tmp_path / "fleet.toml"
    path.write_text(config_text)
    args = ("--workers", "2", "--skip-preflight")
    async with serve_process(path, tmp_path / "serve.log", wait_s=START_S, args=args) as (
        process,
        url,
    ):
        yield Served(process, url, journal)


@contextlib.asynccontextmanager
async def client_of(url: str) -> AsyncIterator[AsyncOpenAI]:
    """An `openai` client that opens a connection of its own for every request, so that
    in front of workers the kernel picks one for each."""
    http = httpx2.AsyncClient(limits=httpx2.Limits(max_keepalive_connections=0))
    async with AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S, http_client=http
    ) as client:
        yield client


async def ask(
    client: AsyncOpenAI, text: str, previous: str | None, *, stream: bool = False
) -> Response:
    """One turn, whole or streamed, following `previous`."""
    if not stream:
        return await client.responses.create(
            model=MODEL,
            input=text,
            max_output_tokens=OUTPUT_TOKENS,
            previous_response_id=previous,
        )
    async with client.responses.stream(
        model=MODEL, input=text, max_output_tokens=OUTPUT_TOKENS, previous_response_id=previous
    ) as events:
        kinds = [event.type async for event in events]
        response = await events.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    return response


async def journal_lines(served: Served, expect: int) -> list[dict[str, Any]]:
    """The journal's request lines once there are `expect` of them."""
    deadline = time.monotonic() + WAIT_S
    lines = [line for line in served.journal() if line["type"] == "request"]
    while len(lines) < expect and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        lines = [line for line in served.journal() if line["type"] == "request"]
    assert len(lines) >= expect, lines
    return lines


def worker_by_response(lines: list[dict[str, Any]]) -> dict[str, int]:
    """Which worker made each response, by its id (the engines' request id, prefixed)."""
    return {
        "resp_" + line["backend_request_ids"][-1]: line["worker"]
        for line in lines
        if line["endpoint"] == "/v1/responses" and line["status"] == 200
    }


def longest_input(engines: list[SimEngine]) -> list[Any]:
    """The longest conversation any consumer was sent as a decode's input."""
    bodies = [
        received.body
        for engine in engines
        for received in engine.received
        if "kv_transfer_params" in received.body and isinstance(received.body.get("input"), list)
    ]
    assert bodies
    longest: list[Any] = max((body["input"] for body in bodies), key=len)
    return longest


def worker_sockets(state: dict[str, Any]) -> dict[int, str]:
    """Each worker's own Unix socket (its peers' way in, which it answers alone), in the run
    directory its command line names."""
    sockets: dict[int, str] = {}
    for slot in state["workers"]["each"]:
        argv = Path(f"/proc/{slot['pid']}/cmdline").read_bytes().split(b"\0")
        run_dir = Path(argv[argv.index(b"--run-dir") + 1].decode())
        sockets[slot["worker"]] = str(run_dir / f"worker-{slot['worker']}.sock")
    assert sorted(sockets) == [0, 1], state["workers"]
    return sockets


async def retrieve_from(socket_path: str, response_id: str) -> dict[str, Any]:
    """`GET /v1/responses/{id}` as one worker alone answers it."""
    connector = aiohttp.UnixConnector(path=socket_path)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get(f"http://worker/v1/responses/{response_id}") as answer,
    ):
        body = await answer.read()
        assert answer.status == 200, body
        kept: dict[str, Any] = orjson.loads(body)
        return kept


def responses_section(kind: str, tmp_path: Path, redis_url: str | None) -> str:
    if kind == "redis":
        return f'[responses]\nstore = "redis"\nredis_url = "{redis_url}"\n'
    # The default store, SQLite: only where its file goes is set.
    return f'[responses]\npath = "{tmp_path / "responses.sqlite3"}"\n'


async def converse(served: Served, client: AsyncOpenAI) -> tuple[list[Response], list[int]]:
    """One conversation through the port, every turn on a connection of its own, whole and
    streamed in turn: its responses and the worker that made each."""
    made: list[Response] = []
    turns: list[int] = []
    for number in range(MAX_TURNS):
        previous = made[-1].id if made else None
        text = f"Turn {number}: and then?"
        response = await ask(client, text, previous, stream=number % 2 == 1)
        assert response.previous_response_id == previous
        assert response.output_text
        made.append(response)
        served_by = worker_by_response(await journal_lines(served, len(made)))
        turns = [served_by[r.id] for r in made]
        if len(made) >= MIN_TURNS and crossings(turns) == {(0, 1), (1, 0)}:
            break
    return made, turns


def crossings(turns: list[int]) -> set[tuple[int, int]]:
    """Each (worker, other worker) of a follow-up made by another worker than its previous."""
    return {(a, b) for a, b in itertools.pairwise(turns) if a != b}


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
async def test_two_workers_carry_one_conversation_whichever_serves_each_turn(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    url = request.getfixturevalue("redis").url if kind == "redis" else None
    journal = tmp_path / "journal.jsonl"
    options = [replace(FAST, name=name) for name, _ in ROLES]
    async with SimFleet(options) as fleet:
        config = fleet_toml(fleet, ROLES, journal, extra=responses_section(kind, tmp_path, url))
        async with (
            serve_two_workers(tmp_path, config, journal) as served,
            client_of(served.url) as client,
        ):
            made, turns = await converse(served, client)
            # A follow-up was served by each worker right after the other had made the
            # response it continues: each worker read what the other stored.
            assert crossings(turns) == {(0, 1), (1, 0)}, turns
            lines = await journal_lines(served, len(made))
            assert len(lines) == len(made)
            assert all(line["status"] == 200 for line in lines), lines
            state = await served.state()
            pids = {slot["worker"]: slot["pid"] for slot in state["workers"]["each"]}
            assert {line["worker"] for line in lines} == set(pids) == {0, 1}, pids

            # The last turn's engines got the whole conversation: every earlier turn's input
            # and output, then its own input.
            whole = longest_input(fleet.engines[1:])
            assert len(whole) == 2 * len(made) - 1
            assert whole[-1]["content"][0]["text"] == f"Turn {len(made) - 1}: and then?"

            # Every response reads back: through the port, and from each worker alone.
            for response in made:
                kept = await client.responses.retrieve(response.id)
                assert kept.output_text == response.output_text
                assert kept.previous_response_id == response.previous_response_id
            sockets = worker_sockets(state)
            for response in made:
                for worker, path in sockets.items():
                    kept_there = await retrieve_from(path, response.id)
                    assert kept_there["id"] == response.id, (worker, kept_there)
            items = await client.responses.input_items.list(made[-1].id)
            assert [item.type for item in items.data] == ["message"]


def replica_config(fleet: SimFleet, redis_url: str, journal: Path) -> dict[str, Any]:
    return {
        "model": MODEL,
        "journal": {"path": str(journal)},
        "responses": {"store": "redis", "redis_url": redis_url},
        "engines": [
            {"id": name, "url": engine.url, "role": role}
            for (name, role), engine in zip(ROLES, fleet.engines, strict=True)
        ],
    }


@contextlib.asynccontextmanager
async def routers(fleet: SimFleet, redis_url: str, tmp_path: Path) -> AsyncIterator[list[str]]:
    """Two replicas over `fleet`, each a router of its own sharing one Redis: their URLs."""
    started: list[RouterServer] = []
    try:
        for name in ("a", "b"):
            journal = tmp_path / f"journal-{name}.jsonl"
            server = RouterServer(
                parse_config(replica_config(fleet, redis_url, journal), "test"), port=0
            )
            await server.start()
            started.append(server)
        yield [server.url for server in started]
    finally:
        for server in started:
            await server.stop()


async def test_a_response_made_on_one_replica_is_continued_and_read_on_another(
    tmp_path: Path, redis: RedisServer
) -> None:
    options = [replace(FAST, name=name) for name, _ in ROLES]
    async with (
        SimFleet(options) as fleet,
        routers(fleet, redis.url, tmp_path) as (url_a, url_b),
        client_of(url_a) as a,
        client_of(url_b) as b,
    ):
        first = await ask(a, "Tell me about whales", None)
        second = await ask(b, "And about narwhals?", first.id, stream=True)
        assert second.previous_response_id == first.id
        assert len(longest_input(fleet.engines[1:])) == 3
        for response in (first, second):
            assert (await b.responses.retrieve(response.id)).output_text == response.output_text
        # And back: A continues what B made.
        third = await ask(a, "Which is larger?", second.id)
        assert len(longest_input(fleet.engines[1:])) == 5
        items = await b.responses.input_items.list(third.id)
        assert items.data[0].model_dump()["content"][0]["text"] == "Which is larger?"
        # A deletion on B is seen on A: the response is gone, its conversation cut.
        await b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as cut:
            await ask(a, "Go on", third.id)
        assert isinstance(cut.value.body, dict)
        assert f"'{first.id}' is not stored" in cut.value.body["message"]


async def test_with_redis_down_the_responses_route_says_so_and_the_others_serve(
    tmp_path: Path, redis: RedisServer
) -> None:
    # The server the router is configured with, stopped before its first Responses request.
    redis.stop()
    options = [replace(FAST, name=name) for name, _ in ROLES]
    journal = tmp_path / "journal.jsonl"
    async with SimFleet(options) as fleet:
        server = RouterServer(
            parse_config(replica_config(fleet, redis.url, journal), "test"), port=0
        )
        await server.start()
        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "input": "hello", "max_output_tokens": OUTPUT_TOKENS}
                for method, route, sent in (
                    ("POST", "/v1/responses", body),
                    ("POST", "/v1/responses", {**body, "previous_response_id": "resp_x"}),
                    ("GET", "/v1/responses/resp_x", None),
                ):
                    async with http.request(method, server.url + route, json=sent) as answer:
                        error = (await answer.json())["error"]
                        assert answer.status == 503, (route, error)
                        assert answer.headers["Retry-After"] == "1"
                    assert error["message"].startswith("the response store is unavailable")
                    assert f"Redis at {redis.url}" in error["message"], error
                # A streamed first turn gets its 503 before any event: the store is
                # opened before the engines are asked.
                streamed = {**body, "stream": True}
                async with http.post(server.url + "/v1/responses", json=streamed) as answer:
                    status, raw = answer.status, await answer.read()
                assert status == 503, raw
                error = orjson.loads(raw)["error"]
                assert error["message"].startswith("the response store is unavailable"), error
                assert [len(engine.received) for engine in fleet.engines] == [0] * len(ROLES)
                for route, sent in (
                    ("/v1/chat/completions", CHAT),
                    ("/v1/completions", COMPLETION),
                ):
                    async with http.post(server.url + route, json=sent) as answer:
                        assert answer.status == 200, await answer.text()

                # Back where it was, Redis is opened by the next Responses request.
                directory = tmp_path / "redis-again"
                directory.mkdir()
                again = start_redis(directory, port=redis.port)
                try:
                    async with client_of(server.url) as client:
                        first = await ask(client, "hello", None)
                        second = await ask(client, "again", first.id, stream=True)
                        kept = await client.responses.retrieve(second.id)
                        assert kept.previous_response_id == first.id
                finally:
                    again.stop()
        finally:
            await server.stop()

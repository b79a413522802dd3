"""Changing a live fleet under steady load fails no request.

`narwhal serve` runs as its own process over simulated engines on real sockets, with eight
streaming `openai` clients sending requests throughout. Meanwhile an operator goes through
every admin action (add, drain, delete, drain and readmit, patch), a SIGHUP reload that
adds one engine and drops another, and a `narwhal reload` that adds one back. No request
may fail, every seat must be free at the end, and the journal has one line per request.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from openai import AsyncOpenAI

from narwhal.tools.sim.fleet import SimFleet
from support.load import WAIT_S, Load, until
from support.stack import FAST, MODEL, serve_process

ADMIN_KEY = "sk-admin-3333333333"
CLIENTS = 8
# Long enough that drains meet requests still running, short enough for many requests.
SIM = replace(FAST, inter_token_s=0.01)


def fleet_file(path: Path, journal: Path, engines: dict[str, tuple[str, str]]) -> None:
    lines = [
        f'model = "{MODEL}"',
        "[server]",
        f'admin_api_keys = ["{ADMIN_KEY}"]',
        "graceful_timeout_s = 10.0",
        "[journal]",
        f'path = "{journal}"',
    ]
    for engine_id, (url, role) in engines.items():
        lines += ["[[engines]]", f'id = "{engine_id}"', f'url = "{url}"', f'role = "{role}"']
    path.write_text("\n".join(lines) + "\n")


class Admin:
    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url
        self.headers = {"Authorization": f"Bearer {ADMIN_KEY}"}

    async def __call__(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.request(
            method, self.url + path, json=body, headers=self.headers
        ) as response:
            return response.status, await response.json()

    async def state(self) -> dict[str, Any]:
        status, state = await self("GET", "/narwhal/state")
        assert status == 200
        return dict(state)

    async def engines(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in (await self.state())["engines"]}

    async def engine_state(self, engine: str) -> str | None:
        entry = (await self.engines()).get(engine)
        return None if entry is None else str(entry["state"])


async def test_every_admin_action_and_reload_under_load_fails_no_request(tmp_path: Path) -> None:
    names = ("p0", "p1", "d0", "d1", "p2", "d2")
    async with SimFleet([replace(SIM, name=name) for name in names]) as sims:
        url = {name: sims.engines[i].url for i, name in enumerate(names)}
        received = {name: sims.engines[i].received for i, name in enumerate(names)}
        path, journal, log = tmp_path / "fleet.toml", tmp_path / "journal.jsonl", tmp_path / "log"
        roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
        fleet_file(path, journal, {n: (url[n], r) for n, r in roles.items()})
        async with serve_process(path, log, wait_s=WAIT_S) as (process, router):
            sent = await exercise(process, router, path, journal, url, received)
        assert process.returncode == 0, log.read_text()
        check_journal(journal, log, sent)


async def exercise(
    process: asyncio.subprocess.Process,
    router: str,
    path: Path,
    journal: Path,
    url: dict[str, str],
    received: dict[str, Any],
) -> int:
    """Every action under load; the number of requests sent."""
    client = AsyncOpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    load = Load(client)
    async with aiohttp.ClientSession() as http, asyncio.TaskGroup() as clients:
        admin = Admin(http, router)
        for index in range(CLIENTS):
            clients.create_task(load.run(index))
        try:
            await load.more(2 * CLIENTS)

            # Add an engine: out until readmission has probed it, then it takes decodes.
            status, body = await admin(
                "POST", "/narwhal/engines", {"id": "d2", "url": url["d2"], "role": "decode"}
            )
            assert status == 201 and body["engine"]["state"] == "ejected", body
            await until(_is(admin.engine_state, "d2", "admitted"), "d2 probed and admitted")
            await until(lambda: len(received["d2"]) > 0, "requests on the added engine")

            # Drain one while requests stream there; delete it once drained.
            status, body = await admin("POST", "/narwhal/engines/d0/drain")
            assert status == 200 and body["engine"]["state"] in ("draining", "drained"), body
            await until(_is(admin.engine_state, "d0", "drained"), "d0 drained")
            status, body = await admin("DELETE", "/narwhal/engines/d0")
            assert (status, body) == (200, {"removed": "d0"})

            # Drain a producer and readmit it.
            status, _ = await admin("POST", "/narwhal/engines/p0/drain")
            assert status == 200
            await until(_is(admin.engine_state, "p0", "drained"), "p0 drained")
            status, body = await admin("POST", "/narwhal/engines/p0/readmit")
            assert status == 200 and body["engine"]["state"] == "admitted", body

            # Change seats and pin in place.
            status, body = await admin(
                "PATCH", "/narwhal/engines/p1", {"max_prefill_seats": 4, "pin": True}
            )
            assert status == 200 and body["engine"]["seats"]["prefill"]["limit"] == 4, body
            await load.more(CLIENTS)

            # SIGHUP: the file now adds p2 and drops d1 (d2 joins the file, d0 stays gone).
            wanted = {"p0": "prefill", "p1": "prefill", "p2": "prefill", "d2": "decode"}
            fleet_file(path, journal, {n: (url[n], r) for n, r in wanted.items()})
            process.send_signal(signal.SIGHUP)

            async def reloaded() -> bool:
                return set(await admin.engines()) == set(wanted)

            await until(reloaded, "the SIGHUP reload to add p2 and remove d1")
            await until(lambda: len(received["p2"]) > 0, "requests on p2")

            # `narwhal reload`: d1 comes back.
            wanted["d1"] = "decode"
            fleet_file(path, journal, {n: (url[n], r) for n, r in wanted.items()})
            cli = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "narwhal", "reload", "--config", str(path)),
                *("--url", router),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(cli.communicate(), WAIT_S)
            assert cli.returncode == 0, err.decode()
            assert orjson.loads(out)["added"] == ["d1"]
            await load.more(2 * CLIENTS)
        finally:
            load.stop.set()
    assert load.failures == [], load.failures[:5]

    async with aiohttp.ClientSession() as http:
        admin = Admin(http, router)

        async def idle() -> dict[str, Any] | None:
            state = await admin.state()
            return state if state["in_flight"] == 0 and state["open_engine_legs"] == 0 else None

        state = await until(idle, "the router to go idle")
    assert {e["id"]: e["state"] for e in state["engines"]} == dict.fromkeys(
        ("p0", "p1", "d1", "p2", "d2"), "admitted"
    )
    for engine in state["engines"]:
        assert engine["seats"]["prefill"]["in_use"] == 0, engine
        assert engine["seats"]["decode"]["in_use"] == 0, engine
    assert state["queued"] == 0
    assert next(e for e in state["engines"] if e["id"] == "p1")["pinned"] is True
    return load.sent


def _is(
    read: Callable[[str], Awaitable[str | None]], engine: str, want: str
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await read(engine) == want

    return check


def check_journal(journal: Path, log: Path, sent: int) -> None:
    lines = [orjson.loads(line) for line in journal.read_bytes().splitlines()]
    requests = [line for line in lines if line["type"] == "request"]
    assert len(requests) == sent, "one journal line per request"
    assert all(line["status"] == 200 for line in requests)
    events = [(line["event"], line["engine"]) for line in lines if line["type"] == "engine"]
    for expected in [
        ("added", "d2"),
        ("draining", "d0"),
        ("drained", "d0"),
        ("removed", "d0"),
        ("draining", "p0"),
        ("drained", "p0"),
        ("readmitted", "p0"),
        ("changed", "p1"),
        ("added", "p2"),
        ("draining", "d1"),
        ("drained", "d1"),
        ("removed", "d1"),
        ("added", "d1"),
        ("readmitted", "d2"),
    ]:
        assert expected in events, (expected, events)
    # Each engine's own events come in the order of the actions; an added engine is probed
    # before it is admitted.
    d1 = [kind for kind, engine in events if engine == "d1"]
    assert d1 == ["draining", "drained", "removed", "added", "probe", "readmitted"], d1
    assert "reloaded" in log.read_text()

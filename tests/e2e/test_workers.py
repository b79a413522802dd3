"""`narwhal serve --workers 2`: one port, two full routers, one supervisor, one router's view."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from narwhal.tools.sim.fleet import SimFleet
from support.stack import FAST, peak_loads
from support.workers import MODEL, Served, fleet_toml, post_fresh, serve_workers

ROLES = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
BODY: dict[str, Any] = {"model": MODEL, "prompt": "The sea is deep and", "max_tokens": 4}


def metric_sum(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def wait_for(served: Served, ready: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    """The merged state once `ready(state)` holds (asserts it does within the timeout)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    state = await served.state()
    while not ready(state):
        assert loop.time() < until, state
        await asyncio.sleep(0.05)
        state = await served.state()
    return state


async def test_two_workers_serve_one_port_and_answer_as_one_router(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    options = [replace(FAST, name=name) for name, _ in ROLES]
    async with SimFleet(options) as fleet:
        config = fleet_toml(fleet, ROLES, journal)
        async with serve_workers(tmp_path, config, 2, journal) as served:
            results = await asyncio.gather(*(post_fresh(served.url, BODY) for _ in range(60)))
            assert [status for status, _ in results] == [200] * 60
            lines = await served.journal_lines(60)
            # Every line whole, each worker served some, and every request has its line.
            assert len(lines) == 60
            assert {line["worker"] for line in lines} == {0, 1}
            metrics = await served.metrics()
            assert metric_sum(metrics, "narwhal_requests_total") == 60
            assert metric_sum(metrics, "narwhal_worker_up") == 2
            by_worker = {
                worker: metric_sum(metrics, f'narwhal_worker_requests_total{{worker="{worker}"}}')
                for worker in ("0", "1")
            }
            assert sum(by_worker.values()) == 60 and all(by_worker.values()), by_worker
            state = await served.state()
            assert state["workers"]["answered"] == [0, 1]
            assert state["in_flight"] == 0
            assert sum(e["kv"]["crossed_decodes"] for e in state["engines"]) == 60
            assert {e["id"]: e["worker_states"] for e in state["engines"]}["d1"] == {
                "0": "admitted",
                "1": "admitted",
            }
            # Each worker placed with its own prefix index; the state shows both, and all.
            placed = state["placement"]
            for view in placed["engines"].values():
                assert set(view["indexed_by_worker"]) == {"0", "1"}, view
                assert view["indexed_chunks"] == sum(view["indexed_by_worker"].values())
            decided = {
                phase: placed["steered"].get(phase, 0) + placed["by_load"].get(phase, 0)
                for phase in ("prefill", "decode")
            }
            # Summed over both workers (each served only some): at least one choice per
            # request and phase (a choice made while no seat was free is made again later).
            assert decided["prefill"] >= 60 and decided["decode"] >= 60, placed

            # An admin change lands on every worker, whichever one took the request.
            async with (
                aiohttp.ClientSession() as http,
                http.post(served.url + "/narwhal/engines/d1/drain") as response,
            ):
                assert response.status == 200, await response.text()
                assert response.headers["X-Narwhal-Workers"] == "2/2"
            state = await served.state()
            d1 = next(e for e in state["engines"] if e["id"] == "d1")
            assert d1["worker_states"] == {"0": "drained", "1": "drained"}
            results = await asyncio.gather(*(post_fresh(served.url, BODY) for _ in range(20)))
            assert [status for status, _ in results] == [200] * 20
            after = (await served.journal_lines(80))[60:]
            assert len(after) == 20 and all(line["consumer"] == "d0" for line in after)


async def test_a_killed_worker_loses_only_its_requests_each_journaled_and_is_replaced(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal.jsonl"
    options = [replace(FAST, name=name, inter_token_s=0.05) for name, _ in ROLES]
    long = {**BODY, "max_tokens": 60, "stream": True}
    async with SimFleet(options) as fleet:
        config = fleet_toml(fleet, ROLES, journal, extra="[engine]\ndecode_read_timeout_s = 30\n")
        async with serve_workers(tmp_path, config, 2, journal) as served:
            warm = await asyncio.gather(*(post_fresh(served.url, BODY) for _ in range(10)))
            assert [status for status, _ in warm] == [200] * 10
            # Long enough for each worker to snapshot its metrics after the warm-up.
            await asyncio.sleep(2.5)
            running = [asyncio.create_task(post_fresh(served.url, long)) for _ in range(16)]
            state = await wait_for(
                served,
                lambda s: (
                    s["in_flight"] == 16 and all(w["in_flight"] for w in s["workers"]["each"])
                ),
            )
            victim = state["workers"]["each"][0]
            os.kill(victim["pid"], signal.SIGKILL)
            results = await asyncio.gather(*running)
            broken = [r for r in results if r[0] != 200 or b"[DONE]" not in r[1]]
            # Exactly the killed worker's requests failed; the other's streamed to the end.
            assert len(broken) == victim["in_flight"]
            lines = (await served.journal_lines(26))[10:]
            lost = [line for line in lines if line["outcome"] == "lost"]
            assert len(lost) == victim["in_flight"]
            assert all(line["worker"] == 0 and line["cause"] == "worker_exited" for line in lost)
            ok = [line for line in lines if line["outcome"] == "ok"]
            assert len(ok) == 16 - victim["in_flight"] and {line["worker"] for line in ok} == {1}
            (replaced,) = await served.journal_lines(1, kind="worker")
            assert replaced["worker"] == 0 and replaced["exit"] == "SIGKILL"
            assert replaced["lost_requests"] == victim["in_flight"]

            # The supervisor put a new worker in its place, and it serves.
            state = await wait_for(served, lambda s: s["workers"]["answered"] == [0, 1])
            slot = state["workers"]["each"][0]
            assert slot["pid"] != victim["pid"] and slot["restarts"] == 1
            assert slot["lost_requests"] == victim["in_flight"]
            metrics = await served.metrics()
            assert metric_sum(metrics, "narwhal_worker_restarts_total") == 1
            assert metric_sum(metrics, "narwhal_worker_lost_requests_total") == victim["in_flight"]
            # The dead worker's counts stay in the router's: its warm-up requests still count.
            assert metric_sum(metrics, "narwhal_requests_total") == 10 + len(ok)
            assert metric_sum(metrics, "narwhal_worker_requests_total") == 10 + len(ok)
            results = await asyncio.gather(*(post_fresh(served.url, BODY) for _ in range(30)))
            assert [status for status, _ in results] == [200] * 30
            assert all(e.running_count() == 0 for e in fleet.engines)


async def test_sigterm_drains_every_worker_then_exits(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    options = [replace(FAST, name=name, inter_token_s=0.02) for name, _ in ROLES]
    long = {**BODY, "max_tokens": 50, "stream": True}
    async with SimFleet(options) as fleet:
        config = fleet_toml(fleet, ROLES, journal, extra="[server]\ngraceful_timeout_s = 20\n")
        async with serve_workers(tmp_path, config, 2, journal) as served:
            running = [asyncio.create_task(post_fresh(served.url, long)) for _ in range(10)]
            await wait_for(
                served,
                lambda s: (
                    s["in_flight"] == 10 and all(w["in_flight"] for w in s["workers"]["each"])
                ),
            )
            served.process.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*running)
            assert all(status == 200 and b"[DONE]" in body for status, body in results)
            assert await asyncio.wait_for(served.process.wait(), 30) == 0
            lines = [line for line in served.journal() if line["type"] == "request"]
            assert len(lines) == 10 and all(line["outcome"] == "ok" for line in lines)
            assert {line["worker"] for line in lines} == {0, 1}
            assert await post_fresh(served.url, BODY) == (0, b"")


async def test_two_workers_keep_every_engine_within_its_seat_limits(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    # Prefills take a while, so that several overlap on the producer as decodes do.
    options = [
        replace(FAST, name=name, inter_token_s=0.01, request_overhead_s=0.03) for name, _ in ROLES
    ]
    stream = {**BODY, "max_tokens": 20, "stream": True}
    async with SimFleet(options) as fleet:
        config = fleet_toml(
            fleet, ROLES, journal, engine_keys="max_prefill_seats = 3\nmax_decode_seats = 3\n"
        )
        async with serve_workers(tmp_path, config, 2, journal) as served:
            state = await served.state()
            shares = {e["id"]: e["seats"] for e in state["engines"]}
            assert shares["d0"]["decode"] == {"in_use": 0, "limit": 3, "share": 3}
            async with peak_loads(fleet.engines) as peak:
                results = await asyncio.gather(*(post_fresh(served.url, stream) for _ in range(60)))
            assert all(status == 200 and b"[DONE]" in body for status, body in results)
            assert all(load <= 3 for load in peak.values()), peak
            # Loaded to their limits, so that the bound above was tested.
            assert max(peak[e] for e in fleet.engines[1:]) == 3, peak
            lines = await served.journal_lines(60)
            assert {line["worker"] for line in lines} == {0, 1}


async def test_a_tenants_per_minute_limit_holds_for_the_whole_router(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    options = [replace(FAST, name=name) for name, _ in ROLES]
    tenants = '[[tenants]]\nname = "batch"\nrequests_per_minute = 12\n'
    policy = '[tenants_policy]\ndefault = "batch"\n'
    async with SimFleet(options) as fleet:
        config = fleet_toml(fleet, ROLES, journal, extra=tenants + policy)
        async with serve_workers(tmp_path, config, 2, journal) as served:
            started = asyncio.get_running_loop().time()
            results = await asyncio.gather(*(post_fresh(served.url, BODY) for _ in range(36)))
            took_s = asyncio.get_running_loop().time() - started
            statuses = [status for status, _ in results]
            # One bucket for both workers: its 12, and one more for every 5 s the requests
            # took to arrive; per worker, each would have let 12 through.
            assert 12 <= statuses.count(200) <= 13 + took_s / 5, (statuses, took_s)
            assert statuses.count(429) == 36 - statuses.count(200)
            lines = await served.journal_lines(36)
            assert {line["worker"] for line in lines if line["status"] == 429} == {0, 1}
            assert {line["tenant"] for line in lines} == {"batch"}

"""Every run of `narwhal goodput` starts on idle engines: a run's leftovers are waited out,
or the engines restarted; the controller run goes between the static splits."""

from __future__ import annotations

import asyncio

import aiohttp

from narwhal.engines.scrape import EngineReport
from narwhal.tools.goodput.command import run_order
from narwhal.tools.goodput.idle import is_idle
from narwhal.tools.goodput.replay import MODEL, FleetProcess

FIELDS = {"profile": "dev", "model": MODEL, "inter_token_s": 0.05}


def test_idle_means_nothing_running_waiting_or_held() -> None:
    assert is_idle(EngineReport(running=0, waiting=0, kv_cache_usage=0))
    assert not is_idle(EngineReport(running=1, waiting=0, kv_cache_usage=0))
    assert not is_idle(EngineReport(running=0, waiting=2, kv_cache_usage=0))
    assert not is_idle(EngineReport(running=0, waiting=0, kv_cache_usage=0.01))
    assert not is_idle(EngineReport())  # an engine that leaves its gauges out
    assert not is_idle(None)  # or cannot be read


def test_the_controller_runs_between_the_static_splits() -> None:
    assert run_order([1, 2, 3], 2, True) == [(1, False), (2, True), (2, False), (3, False)]
    assert run_order([1, 2, 3, 4, 5], 3, True)[2] == (3, True)
    assert run_order([1, 2], 1, False) == [(1, False), (2, False)]


async def test_a_busy_engine_is_waited_for_or_restarted() -> None:
    async with FleetProcess(2, dict(FIELDS)) as fleet:
        fresh = await fleet.fair_start(timeout_s=5.0)
        assert fresh["restarted"] is False
        before = list(fleet.urls)
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "left over", "max_tokens": 2000, "stream": True}
            async with session.post(before[0] + "/v1/completions", json=body) as response:
                assert response.status == 200
                await response.content.readline()  # it is running
                # Still running well past the wait: the engines are restarted.
                busy = await asyncio.wait_for(fleet.fair_start(timeout_s=0.5), 60)
        assert busy["restarted"] is True
        assert fleet.urls != before
        assert (await fleet.fair_start(timeout_s=5.0))["restarted"] is False

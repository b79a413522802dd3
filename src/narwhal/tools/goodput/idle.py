"""A fair start for every run: engines that carry nothing over from the run before.

A run ends when its last client request has its answer, but an engine may still hold work
then (a request the router abandoned and the engine has not noticed yet, KV blocks held
for a handoff nobody pulled). Before each run `narwhal goodput` waits until every engine's
`/metrics` reads idle — nothing running, nothing waiting, no KV block in use — twice in a
row, and restarts the engines when that does not happen in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from narwhal.engines.scrape import EngineReport, read_report

POLL_S = 0.1
READ_TIMEOUT_S = 5.0


def is_idle(report: EngineReport | None) -> bool:
    """An engine is idle when it reports no running or waiting request and an empty KV
    pool; an engine that cannot be read, or that leaves a gauge out, is not."""
    return (
        report is not None
        and report.running == 0
        and report.waiting == 0
        and report.kv_cache_usage == 0
    )


async def wait_idle(urls: Sequence[str], timeout_s: float) -> bool:
    """Whether every engine read idle on two consecutive polls within `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    streak = 0
    async with aiohttp.ClientSession() as session:
        while True:
            reports = await asyncio.gather(
                *(read_report(session, url, READ_TIMEOUT_S) for url in urls)
            )
            streak = streak + 1 if all(is_idle(r) for r in reports) else 0
            if streak >= 2:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(POLL_S)

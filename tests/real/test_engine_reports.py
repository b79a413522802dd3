"""What the router reads of a real engine's /metrics: its load and its queue time (the role
controller's evidence), as vLLM publishes them."""

from __future__ import annotations

import aiohttp
import pytest

from narwhal.engines.scrape import read_report
from support.real import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_both_engines_report_load_and_the_time_requests_queued(real: RealStack) -> None:
    answer = await real.openai().completions.create(
        model=MODEL, prompt="The tide comes in and", max_tokens=4, temperature=0
    )
    assert answer.choices[0].text
    async with aiohttp.ClientSession() as http:
        for engine in (real.producer, real.consumer):
            report = await read_report(http, engine.url, 30.0)
            assert report is not None, engine.url
            assert report.running is not None and report.waiting is not None
            # Every request this engine scheduled was counted with its time in the queue.
            assert report.queue_time_count is not None and report.queue_time_count >= 1
            assert report.queue_time_sum is not None and report.queue_time_sum >= 0.0

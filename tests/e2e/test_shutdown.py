"""Graceful shutdown: refuse new work, let streams finish within the grace period, end the rest."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from narwhal.tools.sim.fleet import SimFleet
from support.stack import (
    COMPLETION,
    FAST,
    StackFactory,
    serve_process,
    settled,
    sse_payloads,
    terminal_error,
)

STREAM = {**COMPLETION, "stream": True}


async def test_draining_refuses_new_requests_and_lets_short_streams_finish(
    make_stack: StackFactory,
) -> None:
    async with make_stack(sim={"inter_token_s": 0.02}) as stack:
        running = asyncio.create_task(stack.post("/v1/completions", {**STREAM, "max_tokens": 10}))
        await asyncio.sleep(0.08)
        draining = asyncio.create_task(stack.server.router.drain(grace_s=5.0))
        await asyncio.sleep(0.02)
        async with stack.http.post(stack.url + "/v1/completions", json=STREAM) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1"
            assert "shutting down" in (await response.json())["error"]["message"]
        async with stack.http.get(stack.url + "/health") as response:
            assert response.status == 503
        status, text = await running
        assert status == 200 and "error" not in text
        await draining


async def test_streams_past_the_grace_period_end_with_a_terminal_error(
    make_stack: StackFactory,
) -> None:
    async with make_stack(sim={"inter_token_s": 0.02}) as stack:
        running = asyncio.create_task(stack.post("/v1/completions", {**STREAM, "max_tokens": 200}))
        await asyncio.sleep(0.1)
        await stack.server.router.drain(grace_s=0.2)
        status, text = await running
        assert status == 200
        assert 0 < len([p for p in sse_payloads(text) if p.get("choices")]) < 200
        error = terminal_error(text)
        assert error["code"] == 503 and "shut down" in error["message"]
        state = await settled(stack)
        assert state["in_flight"] == 0
        (line,) = await stack.journal()
        assert line["status"] == 503 and line["outcome"] == "error"


async def test_sigterm_drains_then_exits(tmp_path: Path) -> None:
    async with SimFleet([FAST]) as fleet:
        path = tmp_path / "fleet.toml"
        path.write_text(
            'model = "narwhal-sim"\n[server]\ngraceful_timeout_s = 2.0\n'
            f'[[engines]]\nid = "b0"\nurl = "{fleet.engines[0].url}"\nrole = "both"\n'
        )
        async with serve_process(path, tmp_path / "serve.log") as (process, _):
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 15) == 0

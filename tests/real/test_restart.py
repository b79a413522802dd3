"""A decode engine killed mid-answer: the client's stream ends with a terminal error, the
router ejects the engine while it refuses connections, and once the engine is back,
readmission returns it at once and requests succeed again. Runs last: it restarts d0.

d1 is drained for the test, so that d0 is the one consumer: the cut answer has nowhere to
be continued, and requests meet d0 while it refuses connections."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from support.real import FIGURES, MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

# `ignore_eos`: the answer runs its whole length, so the kill lands mid-answer.
LONG_ANSWER = {
    "model": MODEL,
    "prompt": "The sea is",
    "max_tokens": 1500,
    "ignore_eos": True,
    "stream": True,
}
PLAIN = {"model": MODEL, "prompt": "The sea is", "max_tokens": 4}


async def state_of(real: RealStack, engine: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(real.server.url + "/narwhal/state") as response,
    ):
        state = await response.json()
    entry: dict[str, Any] = next(e for e in state["engines"] if e["id"] == engine)
    return entry


async def test_a_decode_engine_killed_mid_answer_is_ejected_restarted_and_readmitted(
    real: RealStack,
) -> None:
    operations = real.server.router.operations
    if "d1" not in real.server.router.fleet.by_id:
        await _killed_ejected_restarted_readmitted(real)
        return
    operations.drain("d1", force=True)
    try:
        await _killed_ejected_restarted_readmitted(real)
    finally:
        operations.readmit("d1")


async def _killed_ejected_restarted_readmitted(real: RealStack) -> None:
    events: list[bytes] = []
    async with (
        aiohttp.ClientSession() as http,
        http.post(real.server.url + "/v1/completions", json=LONG_ANSWER) as response,
    ):
        assert response.status == 200
        killed = False
        async for line in response.content:
            if line.startswith(b"data: "):
                events.append(line.removeprefix(b"data: ").strip())
            if len(events) == 20 and not killed:
                await real.consumer.kill()
                killed = True
    assert killed, "the answer ended before it could be cut"
    assert events[-1] == b"[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == 502 and "d0" in error["message"]
    # While d0 refuses connections requests fail (a handoff left unpulled may make the next
    # one wait for the producer's lease: 504), and the breaker ejects d0 as it refuses.
    statuses = []
    for _ in range(10):
        async with (
            aiohttp.ClientSession() as http,
            http.post(real.server.url + "/v1/completions", json=PLAIN) as response,
        ):
            statuses.append(response.status)
        d0 = await state_of(real, "d0")
        if d0["state"] == "ejected":
            break
    assert set(statuses) <= {502, 503, 504}, statuses
    assert d0["state"] == "ejected" and d0["refusing"] is True, (statuses, d0)
    started = time.monotonic()
    await real.consumer.restart()
    # Readmission probes at the urgent interval while no consumer is admitted.
    for _ in range(240):
        d0 = await state_of(real, "d0")
        if d0["state"] == "admitted":
            break
        await asyncio.sleep(0.5)
    assert d0["state"] == "admitted", d0
    FIGURES["consumer restarted and readmitted"] = f"{time.monotonic() - started:.1f} s"
    async with (
        aiohttp.ClientSession() as http,
        http.post(real.server.url + "/v1/completions", json=PLAIN) as response,
    ):
        assert response.status == 200
        assert (await response.json())["choices"][0]["text"]

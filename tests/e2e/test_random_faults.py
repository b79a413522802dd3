"""A randomized fault run: whatever engines and clients do, nothing leaks and every request
ends with exactly one recorded outcome."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from support.stack import COMPLETION, StackFactory, arm, settled

FLEET = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
REQUESTS = 300
CONCURRENCY = 24


def random_fault(rng: random.Random) -> dict[str, Any]:
    k = rng.randint(0, 4)
    return rng.choice(
        [
            {"phase": "prefill", "status": rng.choice([400, 500, 503, 504])},
            {"phase": "decode", "status": rng.choice([500, 503])},
            {"phase": "prefill", "hang_s": 0.5},
            {"phase": "decode", "hang_s": 0.5},
            {"phase": "decode", "first_token_delay_s": 0.5},
            {"phase": "decode", "silence_after": k, "silence_s": 0.5},
            {"phase": "decode", "close_after": k},
            {"phase": "decode", "done_before_token": True},
            {"phase": "decode", "error_after": k, "error_code": rng.choice([500, 503])},
            {"phase": "prefill", "descriptor": rng.choice(["missing_engine_id", "null"])},
            {"phase": "decode", "kv_pull_fail": True},
            {"phase": "decode", "kv_pull_delay_s": 0.05},
            {"refuse_s": 0.1},
        ]
    )


async def one_request(stack: Any, rng: random.Random, index: int) -> str:
    """Send one request; some clients give up part-way. Returns how the client saw it end."""
    body = {**COMPLETION, "prompt": f"request {index}", "stream": rng.random() < 0.7}
    give_up = rng.random() < 0.15
    timeout = aiohttp.ClientTimeout(total=rng.uniform(0.01, 0.3) if give_up else 10)
    try:
        async with stack.http.post(
            stack.url + "/v1/completions", json=body, timeout=timeout
        ) as response:
            await response.read()
            return str(response.status)
    except (TimeoutError, aiohttp.ClientError):
        return "gave up"


async def test_random_faults_and_disconnects_leave_nothing_behind(
    make_stack: StackFactory,
) -> None:
    rng = random.Random(20261130)
    async with make_stack(
        FLEET,
        engine={"first_token_timeout_s": 0.3, "decode_read_timeout_s": 0.3},
        serving={"max_attempts": 2, "retry_budget": 50},
        recovery={"readmit_interval_s": 0.2},
        sim={"inter_token_s": 0.002},
    ) as stack:
        # A client that gives up within milliseconds may do so before its request reaches
        # the router: what arrived is what must be recorded.
        arrived: list[str] = []
        stack.server.router.requests.arrival_hooks.append(
            lambda call: arrived.append(call.request_id)
        )
        semaphore = asyncio.Semaphore(CONCURRENCY)

        async def run(index: int) -> str:
            async with semaphore:
                if rng.random() < 0.3:
                    arm(stack.engine(rng.choice(FLEET)[0]), times=1, **random_fault(rng))
                return await one_request(stack, rng, index)

        seen = await asyncio.gather(*(run(i) for i in range(REQUESTS)))
        for engine in stack.fleet.engines:
            engine.clear_faults()
        await settled(stack)
        lines = await stack.journal(len(arrived), kind="request")

    assert REQUESTS - len(arrived) <= seen.count("gave up")
    assert len(lines) == len(arrived) > REQUESTS // 2
    assert sorted(line["request_id"] for line in lines) == sorted(arrived)
    allowed = {200, 400, 499, 500, 502, 503, 504}
    assert {line["status"] for line in lines} <= allowed
    for line in lines:
        assert line["outcome"] in {"ok", "client_closed", "timeout", "client_error", "error"}
        assert (line["error"] is None) == (line["status"] == 200)
        assert 1 <= line["attempts"] <= 2 or line["status"] in (499, 503)
    assert seen.count("200") >= REQUESTS // 2
    assert "gave up" in seen

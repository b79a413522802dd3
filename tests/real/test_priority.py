"""vLLM's `priority` field on real engines: what `[tenants_policy] engine_priority` sends.

One engine of its own, q0, beside the session's pair: started with `--scheduling-policy
priority`, one running request at most (`--max-num-seqs 1`, so that requests queue and the
order they are served in is the scheduler's), and the NixlConnector as `kv_both`, so that it
serves a prefill leg for the session's consumer and a decode leg from the session's
producer. It takes both legs with `priority` set, and a request queued later with a lower
priority is served before one queued earlier: the field reaches the scheduler.

An engine started without the policy (vLLM's default, `fcfs`) does not refuse a non-zero
priority: vLLM 0.32 answers 200 and ignores it (its V0 engine refused one). Both validate
the field alike, as a 64-bit integer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from narwhal.protocol.descriptor import prefill_request_params
from narwhal.tools.vllm_fleet import VllmEngine, VllmFleet, VllmOptions
from support.real import (
    CLIENT_TIMEOUT_S,
    FIGURES,
    KV_LEASE_S,
    MODEL,
    TINY_MODEL,
    VLLM_PYTHON,
    RealStack,
    counter,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "The whales sing under grey skies and"
MAX_TOKENS = 16
PULLED = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer")
# Long enough to hold q0's one seat while two more requests queue behind it (about 15 s on
# an idle 2-core machine), short enough for the tiny model's 2,048-token context.
HOLD_TOKENS = 1900


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def q0(real: RealStack) -> AsyncIterator[VllmEngine]:
    """One engine with priority scheduling, started after the session's (so that the two
    starts do not share the CPU)."""
    options = VllmOptions(
        python=VLLM_PYTHON,
        model=TINY_MODEL,
        served_model_name=MODEL,
        log_dir=real.fleet.options.log_dir / "priority",
        extra_args=("--max-num-seqs", "1"),
        kv_lease_duration_s=KV_LEASE_S,
        scheduling_policy="priority",
    )
    started = time.monotonic()
    async with VllmFleet(options, [("q0", "both")]) as fleet:
        FIGURES["priority engine started"] = f"{time.monotonic() - started:.1f} s"
        FIGURES["q0 memory (PSS)"] = f"{fleet['q0'].memory_mib():.0f} MiB"
        yield fleet["q0"]


async def post(
    engine: VllmEngine, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(engine.url + path, json={"model": MODEL, **body}) as response,
    ):
        return response.status, await response.json()


def greedy(priority: int, **fields: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "priority": priority}
    return body | fields


async def test_an_engine_with_priority_scheduling_takes_both_legs_with_priority(
    real: RealStack, q0: VllmEngine
) -> None:
    status, alone = await post(q0, greedy(3))
    assert status == 200, alone
    # q0 prefills for the session's consumer...
    status, prefill = await post(
        q0, greedy(-1, max_tokens=1, kv_transfer_params=prefill_request_params())
    )
    assert status == 200, prefill
    descriptor = prefill["kv_transfer_params"]
    assert descriptor and descriptor["do_remote_prefill"] is True, prefill
    status, decoded = await post(real.consumer, greedy(-1, kv_transfer_params=descriptor))
    assert status == 200, decoded
    # ...and decodes from the session's producer, pulling the prompt's KV.
    pulled = await counter(q0, PULLED[0], source=PULLED[1])
    status, prefill = await post(
        real.producer, greedy(2, max_tokens=1, kv_transfer_params=prefill_request_params())
    )
    assert status == 200, prefill
    status, decoded = await post(q0, greedy(2, kv_transfer_params=prefill["kv_transfer_params"]))
    assert status == 200, decoded
    assert decoded["choices"][0]["text"] == alone["choices"][0]["text"]
    assert await counter(q0, PULLED[0], source=PULLED[1]) > pulled


async def test_a_later_request_with_a_lower_priority_is_served_first(q0: VllmEngine) -> None:
    """q0's one seat is held; priority 5 then priority -5 queue behind it; the seat is
    freed (the holder's client leaves, which aborts it): -5 is served before 5."""
    first_tokens: dict[int, float] = {}
    queued: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    body = {"model": MODEL, **greedy(0, max_tokens=HOLD_TOKENS, ignore_eos=True, stream=True)}
    async with aiohttp.ClientSession(timeout=timeout) as http:
        try:
            async with http.post(q0.url + "/v1/completions", json=body) as holder:
                assert holder.status == 200
                await holder.content.readline()  # its first token: it runs
                for priority in (5, -5):
                    queued.append(
                        asyncio.create_task(first_token_at(http, q0, priority, first_tokens))
                    )
                    await until_waiting(q0, len(queued))
            # Leaving the block closed the holder's connection: vLLM aborts it.
            async with asyncio.timeout(CLIENT_TIMEOUT_S):
                await asyncio.gather(*queued)
        finally:
            for task in queued:
                task.cancel()
    assert first_tokens[-5] < first_tokens[5], first_tokens


async def first_token_at(
    http: aiohttp.ClientSession, engine: VllmEngine, priority: int, seen: dict[int, float]
) -> None:
    """Stream a short greedy completion; note when its first token came, read the rest."""
    body = {"model": MODEL, **greedy(priority, max_tokens=4, stream=True)}
    async with http.post(engine.url + "/v1/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: ") and priority not in seen:
                seen[priority] = time.monotonic()


async def until_waiting(engine: VllmEngine, count: int) -> None:
    """Until the engine's scheduler has `count` requests waiting (its own gauge); they can
    only all wait while the holder runs."""
    deadline = time.monotonic() + 60
    # A gauge on /metrics: nothing to await but another reading.
    while await counter(engine, "vllm:num_requests_waiting") != count:
        assert time.monotonic() < deadline, f"never {count} waiting: did the holder end?"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_engine_without_priority_scheduling_ignores_a_priority(
    real: RealStack, path: str
) -> None:
    body = greedy(5)
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "priority": 5}
    status, answer = await post(real.producer, body, path)
    assert status == 200, answer
    # The field is still read as an integer: a fraction is the request model's 400.
    status, answer = await post(real.producer, body | {"priority": 1.5}, path)
    assert status == 400
    assert (answer["error"]["type"], answer["error"]["param"]) == ("Bad Request", "body.priority")
    assert "int_from_float" in answer["error"]["message"]

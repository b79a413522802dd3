"""vLLM's `priority` field on real engines: what `[tenants_policy] engine_priority` sends.

One engine of its own, q0, beside the session's pair: started with `--scheduling-policy
priority`, one running request at most (`--max-num-seqs 1`, so that requests queue and the
order they are served in is the scheduler's), and the NixlConnector as `kv_both`, so that it
serves a prefill leg for the session's consumer and a decode leg from the session's
producer. It takes both legs with `priority` set, and a request queued later with a lower
priority is served before one queued earlier: the field reaches the scheduler.

Through the router, with two tenants (`batch` in band 5, `chat` in band -5) and
`[tenants_policy] engine_priority`, the later chat request is served before the earlier
batch one at q0's seat: the band reaches the engine on both legs. Without the policy the
same two requests are served in arrival order.

The seat is held by a stream of a fixed length; when it ends by itself before the requests
under test have all queued (a slow step between them on a loaded machine), arrival chose
the order, and the trial is run again (at most `TRIALS`; the count is in the figures).

An engine started without the policy (vLLM's default, `fcfs`) does not refuse a non-zero
priority: vLLM 0.32 answers 200 and ignores it (its V0 engine refused one). Both validate
the field alike, as a 64-bit integer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.config.secrets import load_secrets
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
# A holder that ends by itself before the requests under test have all queued (a slow step
# between them on a loaded machine) leaves the order to arrival: that trial is run again.
TRIALS = 3
# Through the router the second first token comes only after the whole first answer (one
# seat): answers this long keep the two apart by a few tenths of a second, past a pause of
# the test's own event loop, which serves the router and both clients.
ROUTED_TOKENS = 64
# Two tenants through the router: a band each, lower first. Their clients ask for their own
# `priority` too, each pulling against the order the test expects (see the test).
KEYS = {"batch": "sk-batch-real-1111", "chat": "sk-chat-real-2222"}
TENANTS = [
    {"name": "batch", "api_keys": [KEYS["batch"]], "priority": 5},
    {"name": "chat", "api_keys": [KEYS["chat"]], "priority": -5},
]


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
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        def asking(priority: int) -> Callable[[], Coroutine[Any, Any, None]]:
            return lambda: first_token_at(http, q0, priority, first_tokens)

        trials = 0
        while trials < TRIALS:
            trials += 1
            first_tokens.clear()
            if await queued_then_served(http, q0, [asking(5), asking(-5)]):
                break
        else:
            pytest.fail(f"in {TRIALS} trials the seat's holder never outlasted the queueing")
    FIGURES["engine priority order, trials"] = str(trials)
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


async def queued_then_served(
    http: aiohttp.ClientSession,
    engine: VllmEngine,
    requests: Sequence[Callable[[], Coroutine[Any, Any, None]]],
) -> bool:
    """Hold a one-seat engine's seat, start `requests` in order, each once the one before
    waits in the engine's queue, then free the seat and see them all served. False (each
    cancelled, the engine idle again) when the holder ended by itself before they all
    waited: then arrival, not the scheduler, chose the order."""
    tasks: list[asyncio.Task[None]] = []
    queued = False
    try:
        async with seat_held(http, engine) as ended:
            for request in requests:
                tasks.append(asyncio.create_task(request()))
                if not await until_waiting(engine, len(tasks), ended):
                    break
            else:
                queued = True
        if queued:
            async with asyncio.timeout(CLIENT_TIMEOUT_S):
                await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not queued:
        await until_idle(engine)
    return queued


async def until_waiting(engine: VllmEngine, count: int, ended: asyncio.Event) -> bool:
    """Until the engine's scheduler has `count` requests waiting (its own gauge): True;
    False once the seat's holder has ended (they can only all wait while it runs)."""
    deadline = time.monotonic() + 60
    # A gauge on /metrics: nothing to await but another reading.
    while await counter(engine, "vllm:num_requests_waiting") != count:
        if ended.is_set():
            return False
        assert time.monotonic() < deadline, f"never {count} waiting, the holder still running"
        await asyncio.sleep(0.1)
    return True


async def until_idle(engine: VllmEngine) -> None:
    """Until the engine runs and queues nothing (cancelled requests are aborted)."""
    deadline = time.monotonic() + 60
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        while await counter(engine, gauge) != 0:
            assert time.monotonic() < deadline, f"{engine.name} never idle ({gauge})"
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


async def test_through_the_router_a_tenants_band_orders_the_engines_queue(
    real: RealStack, q0: VllmEngine
) -> None:
    """q0 alone behind a router, in role `both`: it serves both legs of each request (the
    decode from its own prefix cache, no KV transfer), so both legs wait for its one seat.
    The seat is held; a batch request, then a chat request, go through the router, which
    seats both at once (q0's router seats, 64 and 256 by default, are far from full), so
    that both prefill legs wait in q0's own queue, and the order they are served in is q0's
    scheduler's, not the router's (which would also put chat first). The seat is freed.

    With `engine_priority` chat (band -5) gets its first token first; its decode leg then
    takes the seat for its whole answer before batch's decode can start. (Without it the
    router sends no priority, and an engine serves in arrival order: the simulator's
    tests/e2e/test_tenants.py shows the router drops a client's own.)

    Each client also sends a `priority` of its own, pulling against the expected order
    (the tenant expected second asks for -10): the router overrides it with the band, or
    drops it, and a router passing it on would fail this test either way."""
    engine_priority = True
    expected = ["chat", "batch"]
    own = {expected[0]: 10, expected[1]: -10}
    journal = real.fleet.options.log_dir / "priority" / f"journal-{engine_priority}.jsonl"
    config = parse_config(
        {
            "model": MODEL,
            "engine": {
                "first_token_timeout_s": 60.0,
                "decode_read_timeout_s": 60.0,
                "metrics_interval_s": 0,
                "kv_lease_s": KV_LEASE_S,
            },
            "journal": {"path": str(journal)},
            "tenants": TENANTS,
            "tenants_policy": {"engine_priority": engine_priority},
            "engines": [{"id": q0.name, "url": q0.url, "role": "both", "model": MODEL}],
        },
        source="tests/real (tenant priority)",
    )
    status, alone = await post(q0, greedy(0, max_tokens=ROUTED_TOKENS))
    assert status == 200, alone
    first_tokens: dict[str, float] = {}
    texts: dict[str, str] = {}
    server = RouterServer(config, port=0, secrets=load_secrets(config, {}))
    await server.start()
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:

            def asking(tenant: str) -> Callable[[], Coroutine[Any, Any, None]]:
                return lambda: through(http, server, tenant, own[tenant], first_tokens, texts)

            trials = 0
            while trials < TRIALS:
                trials += 1
                first_tokens.clear()
                texts.clear()
                if await queued_then_served(http, q0, [asking("batch"), asking("chat")]):
                    break
            else:
                pytest.fail(f"in {TRIALS} trials the seat's holder never outlasted the queueing")
    finally:
        await server.stop()
    FIGURES["tenant band order through the router, trials"] = str(trials)
    start = min(first_tokens.values())
    after = {tenant: f"+{at - start:.2f} s" for tenant, at in first_tokens.items()}
    assert sorted(first_tokens, key=first_tokens.__getitem__) == expected, after
    assert texts == dict.fromkeys(("batch", "chat"), alone["choices"][0]["text"])
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    for tenant in ("batch", "chat"):
        # The last trial's (an earlier one's requests were cancelled).
        entry = [e for e in entries if e.get("client_request_id") == f"priority-{tenant}"][-1]
        seen = [entry[key] for key in ("tenant", "producer", "consumer", "handoff", "attempts")]
        assert seen == [tenant, q0.name, q0.name, "same_worker", 1], entry


@asynccontextmanager
async def seat_held(
    http: aiohttp.ClientSession, engine: VllmEngine
) -> AsyncIterator[asyncio.Event]:
    """Hold a one-seat engine's seat with a long greedy stream while the block runs;
    leaving it closes the stream's connection, which vLLM aborts, freeing the seat. Yields
    an event set once the stream has ended by itself (its tokens all generated)."""
    body = {"model": MODEL, **greedy(0, max_tokens=HOLD_TOKENS, ignore_eos=True, stream=True)}
    ended = asyncio.Event()

    async def read_to_end(holder: aiohttp.ClientResponse) -> None:
        try:
            async for _ in holder.content:
                pass
        finally:
            ended.set()

    async with http.post(engine.url + "/v1/completions", json=body) as holder:
        assert holder.status == 200
        await holder.content.readline()  # its first token: it runs
        reader = asyncio.create_task(read_to_end(holder))
        try:
            yield ended
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def through(
    http: aiohttp.ClientSession,
    server: RouterServer,
    tenant: str,
    priority: int,
    seen: dict[str, float],
    texts: dict[str, str],
) -> None:
    """A streamed greedy completion through the router with the tenant's key: when its
    first token came, and its whole text."""
    body = greedy(priority, max_tokens=ROUTED_TOKENS, stream=True) | {"model": MODEL}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "X-Request-Id": f"priority-{tenant}"}
    text = ""
    async with http.post(server.url + "/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                seen.setdefault(tenant, time.monotonic())
                text += choice["text"]
    texts[tenant] = text

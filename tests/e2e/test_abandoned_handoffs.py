"""A descriptor dropped before any consumer got it is counted against its producer, with the
blocks it holds, and released through a consumer so the producer frees them at once; a
delivered one, or a handoff that holds nothing, never is."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.engines.http import ConnectionPool, Origin
from support.stack import COMPLETION, Stack, StackFactory, arm, router_state, settled

STREAM = {**COMPLETION, "stream": True}
LONG_PROMPT = {**STREAM, "prompt": "whales sing " * 40}


async def abandoned_of(
    stack: Stack, engine: str, want: int, timeout_s: float = 30.0, *, released: int = 0
) -> Any:
    """The engine's `abandoned` entry in `/narwhal/state` once it counts `want` handoffs
    and `released` releases that freed blocks."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while True:
        state = await router_state(stack)
        entry = next(e for e in state["engines"] if e["id"] == engine)["abandoned"]
        done = entry["handoffs"] >= want and entry["released"] >= released
        if done or loop.time() > until:
            return entry
        await asyncio.sleep(0.02)


KEEP = {"release_abandoned": False}


async def metric_totals(stack: Stack) -> dict[str, float]:
    async with stack.http.get(stack.url + "/metrics") as response:
        text = await response.text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("narwhal_engine_abandoned"):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def test_a_normal_request_abandons_nothing(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        status, _ = await stack.post("/v1/completions", LONG_PROMPT)
        assert status == 200
        (line,) = await stack.journal(kind="request")
        assert line["handoff"] == "crossed"
        assert line["abandoned_handoffs"] == {
            "count": 0,
            "blocks": 0,
            "block_seconds": 0,
            "handoffs": [],
        }
        state = await settled(stack)
        p0, d0 = state["engines"]
        assert p0["abandoned"] == {
            "handoffs": 0,
            "blocks": 0,
            "block_seconds": 0.0,
            "pinned_blocks": 0,
            "released": 0,
            "release_failures": 0,
        }
        assert d0["abandoned"] is None
        assert stack.engine("p0").held_block_count() == 0


@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
async def test_a_client_gone_after_the_prefill_abandons_its_handoff(
    make_stack: StackFactory, release: bool
) -> None:
    async with make_stack(engine={"release_abandoned": release}) as stack:
        consumer = Origin.of(stack.engine("d0").url)
        connecting = asyncio.Event()
        never = asyncio.Event()
        pool = stack.server.router.client._pool
        assert isinstance(pool, ConnectionPool)
        connect = pool._connect

        async def slow_connect(origin: Origin) -> Any:
            # The decode's connection to the consumer takes its time: the prefill is
            # answered, its descriptor not yet sent.
            if origin == consumer:
                connecting.set()
                await never.wait()
            return await connect(origin)

        pool._connect = slow_connect  # type: ignore[method-assign]
        client = asyncio.create_task(stack.post("/v1/completions", LONG_PROMPT))
        await asyncio.wait_for(connecting.wait(), 10)
        client.cancel()
        if release:
            # The release goes to a consumer too: let it connect.
            pool._connect = connect  # type: ignore[method-assign]
        entry = await abandoned_of(stack, "p0", 1, released=int(release))
        (line,) = await stack.journal(kind="request")
        assert line["status"] == 499
        blocks = line["abandoned_handoffs"]["blocks"]
        assert blocks > 0 and line["abandoned_handoffs"]["count"] == 1
        assert [h["producer"] for h in line["abandoned_handoffs"]["handoffs"]] == ["p0"]
        assert entry["handoffs"] == 1 and entry["blocks"] == blocks
        # Nearly the whole 30 s lease was left when it was dropped.
        assert 25 * blocks <= entry["block_seconds"] <= 30 * blocks
        totals = await metric_totals(stack)
        assert totals["narwhal_engine_abandoned_handoffs_total"] == 1
        assert totals["narwhal_engine_abandoned_blocks_total"] == blocks
        held = stack.engine("p0").held_block_count()
        if release:
            # Freed at once, not at the end of the lease.
            assert held == 0 and entry["pinned_blocks"] == 0 and entry["released"] == 1
            assert totals["narwhal_engine_abandoned_pinned_blocks"] == 0
            assert totals["narwhal_engine_abandoned_releases_total"] == 1
            (release_request,) = stack.engine("d0").received
            assert release_request.body["model"] == "narwhal-release-abandoned-handoff"
        else:
            assert held == blocks and entry["pinned_blocks"] == blocks
            assert entry["released"] == 0
            assert totals["narwhal_engine_abandoned_pinned_blocks"] == blocks
            pool._connect = connect  # type: ignore[method-assign]
            assert len(stack.engine("d0").received) == 0


async def test_an_expired_handoff_is_abandoned(make_stack: StackFactory) -> None:
    engine = {"kv_lease_s": 0.6, "prefill_timeout_s": 5.0, **KEEP}
    async with make_stack(engine=engine) as stack:
        arm(stack.engine("p0"), phase="prefill", hang_s=0.55)
        status, body = await stack.post("/v1/completions", LONG_PROMPT)
        assert status == 504 and body["error"]["message"].startswith("handoff expired")
        entry = await abandoned_of(stack, "p0", 1)
        held = stack.engine("p0").held_block_count()
        assert held > 0
        assert entry["handoffs"] == 1 and entry["blocks"] == held
        # Past the bound (five sixths of the lease): at most a sixth of it was left.
        assert entry["block_seconds"] <= 0.1 * held + 1e-6
        (line,) = await stack.journal(kind="request")
        assert line["abandoned_handoffs"]["count"] == 1
        assert len(stack.engine("d0").received) == 0


async def test_a_refused_decode_abandons_its_handoff_and_the_retry_does_not(
    make_stack: StackFactory,
) -> None:
    async with make_stack(serving={"max_attempts": 2}) as stack:
        arm(stack.engine("d0"), phase="decode", status=503, times=1)
        status, _ = await stack.post("/v1/completions", LONG_PROMPT)
        assert status == 200
        (line,) = await stack.journal(kind="request")
        assert line["attempts"] == 2
        entry = await abandoned_of(stack, "p0", 1, released=1)
        blocks = line["abandoned_handoffs"]["blocks"]
        assert line["abandoned_handoffs"]["count"] == 1 and blocks > 0
        assert entry["handoffs"] == 1 and entry["blocks"] == blocks
        # The second attempt's blocks were pulled, the first attempt's released.
        assert entry["released"] == 1 and entry["pinned_blocks"] == 0
        assert stack.engine("p0").held_block_count() == 0
        await settled(stack)


async def test_a_decode_that_failed_after_it_was_sent_is_not_abandoned(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        # The consumer took the request and its pull failed: it had the descriptor.
        arm(stack.engine("d0"), phase="decode", kv_pull_fail=True, times=1)
        status, _ = await stack.post("/v1/completions", LONG_PROMPT)
        assert status != 200
        (line,) = await stack.journal(kind="request")
        assert line["abandoned_handoffs"]["count"] == 0
        state = await settled(stack)
        assert state["engines"][0]["abandoned"]["handoffs"] == 0


async def test_a_same_worker_handoff_pins_nothing(make_stack: StackFactory) -> None:
    async with make_stack(
        (("b0", "both"),), engine={"prefill_timeout_s": 10.0, "first_token_timeout_s": 0.3}
    ) as stack:
        # Both legs are slow to their first token: the prefill within its timeout, the
        # decode past its own.
        arm(stack.engine("b0"), first_token_delay_s=0.6, times=2)
        status, _ = await stack.post("/v1/completions", LONG_PROMPT)
        assert status == 504
        (line,) = await stack.journal(kind="request")
        assert line["handoff"] == "same_worker"
        assert line["abandoned_handoffs"]["count"] == 0
        state = await settled(stack)
        assert state["engines"][0]["abandoned"]["handoffs"] == 0


# Two pools: pool b's engines first in the file, pool narwhal-sim's with two consumers.
TWO_POOLS = (
    ("pb", "prefill"),
    ("db", "decode"),
    ("p0", "prefill"),
    ("d0", "decode"),
    ("d1", "decode"),
)
POOL_B = {"model": "model-b"}


async def test_a_release_goes_to_a_consumer_of_the_producers_own_pool(
    make_stack: StackFactory,
) -> None:
    async with make_stack(
        TWO_POOLS,
        sim_by_engine={"pb": POOL_B, "db": POOL_B},
        engine_keys={"pb": POOL_B, "db": POOL_B},
        models=[{"name": "model-b"}],
    ) as stack:
        router = stack.server.router
        consumers = {Origin.of(stack.engine(name).url): name for name in ("d0", "d1")}
        connecting = asyncio.Event()
        never = asyncio.Event()
        chosen: list[str] = []
        pool = router.client._pool
        assert isinstance(pool, ConnectionPool)
        connect = pool._connect

        async def slow_connect(origin: Origin) -> Any:
            # The decode's connection to the consumer chosen never completes.
            if origin in consumers and not chosen:
                chosen.append(consumers[origin])
                connecting.set()
                await never.wait()
            return await connect(origin)

        pool._connect = slow_connect  # type: ignore[method-assign]
        client = asyncio.create_task(stack.post("/v1/completions", LONG_PROMPT))
        await asyncio.wait_for(connecting.wait(), 10)
        # The chosen consumer is now known to refuse connections: the release needs another
        # consumer, and pool b's comes first in the fleet.
        router.fleet.by_id[chosen[0]].refusing = True
        client.cancel()
        entry = await abandoned_of(stack, "p0", 1, released=1)
        assert entry["released"] == 1 and entry["pinned_blocks"] == 0
        assert stack.engine("p0").held_block_count() == 0
        (other,) = {"d0", "d1"} - set(chosen)
        (release_request,) = stack.engine(other).received
        assert release_request.body["model"] == "narwhal-release-abandoned-handoff"
        assert not stack.engine("db").received and not stack.engine(chosen[0]).received
        pool._connect = connect  # type: ignore[method-assign]

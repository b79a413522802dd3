"""A failing engine never takes the whole service down: on a one-producer, one-consumer fleet
with the default breaker, a good request right after any run of failures is answered 200,
and the journal shows how (an engine spared, aggregate fallback, panic, readmission)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from support.stack import (
    COMPLETION,
    Stack,
    StackFactory,
    arm,
    engine_state,
    hold_readmission,
    router_state,
)

# Engine timeouts short enough that timeouts fire quickly; the breaker keeps its defaults.
QUICK_TIMEOUTS = {
    "first_token_timeout_s": 1.0,
    "prefill_timeout_s": 1.0,
    "decode_read_timeout_s": 0.5,
    "connect_timeout_s": 1.0,
}
# More than eject_after (3) in a row.
RUN = 4

PREFILL_FAULTS: dict[str, dict[str, Any]] = {
    "http_status": {"status": 500},
    "descriptor": {"descriptor": "missing_engine_id"},
    "prefill_timeout": {"hang_s": 3.0},
}
DECODE_FAULTS: dict[str, dict[str, Any]] = {
    "http_status": {"status": 503},
    "first_token_timeout": {"first_token_delay_s": 3.0},
    "closed_early": {"close_after": 1},
    "silence": {"silence_after": 1, "silence_s": 3.0},
    "error_object": {"error_after": 1},
    "done_before_token": {"done_before_token": True},
    "kv_pull_fail": {"kv_pull_fail": True},
}


async def fail_run(
    stack: Stack, engine: str, phase: str, fault: dict[str, Any], count: int = RUN
) -> None:
    arm(stack.engine(engine), phase=phase, times=count, **fault)
    for _ in range(count):
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert 500 <= status <= 504


async def good_request(stack: Stack, before: int = RUN) -> dict[str, Any]:
    """A request that must succeed, and its journal line: `before` requests came first."""
    status, body = await stack.post("/v1/completions", COMPLETION)
    assert status == 200, body
    return (await stack.journal(before + 1, kind="request"))[-1]


@pytest.mark.parametrize("kind", sorted(PREFILL_FAULTS))
async def test_a_run_of_prefill_failures_leaves_the_last_producer_serving(
    make_stack: StackFactory, kind: str
) -> None:
    async with make_stack(engine=QUICK_TIMEOUTS) as stack:
        await fail_run(stack, "p0", "prefill", PREFILL_FAULTS[kind])
        line = await good_request(stack)
        assert line["handoff"] == "crossed" and line["producer"] == "p0"
        p0 = await engine_state(stack, "p0", "admitted")
        assert p0["state"] == "admitted" and p0["spared"] == 1 and p0["ejections"] == 0


@pytest.mark.parametrize("kind", sorted(DECODE_FAULTS))
async def test_a_run_of_decode_failures_leaves_the_last_consumer_serving(
    make_stack: StackFactory, kind: str
) -> None:
    async with make_stack(engine=QUICK_TIMEOUTS) as stack:
        await fail_run(stack, "d0", "decode", DECODE_FAULTS[kind])
        line = await good_request(stack)
        assert line["handoff"] == "crossed" and line["consumer"] == "d0"
        d0 = await engine_state(stack, "d0", "admitted")
        assert d0["state"] == "admitted" and d0["spared"] == 1 and d0["ejections"] == 0


async def test_a_producer_refusing_connections_is_ejected_and_the_consumer_serves_alone(
    make_stack: StackFactory,
) -> None:
    async with make_stack(engine=QUICK_TIMEOUTS) as stack:
        await stack.engine("p0").crash()
        for _ in range(3):
            assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        assert (await engine_state(stack, "p0", "ejected"))["refusing"] is True
        received = len(stack.engine("d0").received)
        status, body = await stack.post("/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200 and body.endswith("data: [DONE]\n\n")
        line = (await stack.journal(4, kind="request"))[-1]
        assert line["handoff"] == "fallback" and line["producer"] is None
        assert line["consumer"] == "d0" and line["crossed"] is False
        # One leg only, and it carries no descriptor: the consumer computed the prompt.
        (decode,) = list(stack.engine("d0").received)[received:]
        assert "kv_transfer_params" not in decode.body and decode.body["stream"] is True
        state = await router_state(stack)
        assert state["degraded"] is True and state["can_serve"] is True
        assert state["recent"]["handoffs"] == {"fallback": 1}
        async with stack.http.get(stack.url + "/metrics") as response:
            assert 'narwhal_handoffs_total{kind="fallback"} 1.0' in await response.text()
        health = await stack.http.get(stack.url + "/health")
        assert health.status == 200 and (await health.json())["status"] == "degraded"


async def test_a_restarted_last_producer_is_readmitted_at_the_urgent_interval(
    make_stack: StackFactory,
) -> None:
    # The ordinary interval is far away: only the urgent one can bring p0 back in time.
    recovery = {"readmit_interval_s": 300.0}
    async with make_stack(engine=QUICK_TIMEOUTS, recovery=recovery) as stack:
        await stack.engine("p0").crash()
        for _ in range(3):
            await stack.post("/v1/completions", COMPLETION)
        await engine_state(stack, "p0", "ejected")
        await stack.engine("p0").restart()
        p0 = await engine_state(stack, "p0", "admitted", timeout_s=20.0)
        assert p0["state"] == "admitted"
        line = await good_request(stack, before=3)
        assert line["handoff"] == "crossed" and line["producer"] == "p0"
        events = [e["event"] for e in await stack.journal(1, kind="engine")]
        assert "readmitted" in events


async def test_a_consumer_refusing_connections_is_used_again_once_it_answers(
    make_stack: StackFactory,
) -> None:
    async with make_stack(engine=QUICK_TIMEOUTS) as stack:
        arm(stack.engine("d0"), phase="decode", refuse_s=1.5, times=1)
        for _ in range(3):
            assert (await stack.post("/v1/completions", COMPLETION))[0] in (502, 503)
        # Within a few urgent intervals of the engine taking connections again, it serves.
        await asyncio.sleep(1.5)
        for _ in range(100):
            status, _ = await stack.post("/v1/completions", COMPLETION)
            if status == 200:
                break
            await asyncio.sleep(0.1)
        assert status == 200
        events = [e["event"] for e in await stack.journal(1, kind="engine")]
        line = (await stack.journal(1, kind="request"))[-1]
        assert "readmitted" in events or line["panic"] is True


async def test_with_no_cap_an_ejected_last_consumer_serves_by_panic_placement(
    make_stack: StackFactory,
) -> None:
    recovery = {"max_ejected_fraction": 1.0}
    async with make_stack(engine=QUICK_TIMEOUTS, recovery=recovery) as stack:
        hold_readmission(stack)
        await fail_run(stack, "d0", "decode", {"status": 500}, count=3)
        assert (await engine_state(stack, "d0", "ejected"))["state"] == "ejected"
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 200
        line = (await stack.journal(4, kind="request"))[-1]
        assert line["panic"] is True and line["consumer"] == "d0"
        assert (await engine_state(stack, "d0", "ejected"))["panic_placements"] == 1


async def test_with_no_cap_an_ejected_last_producer_leaves_the_consumer_serving_alone(
    make_stack: StackFactory,
) -> None:
    recovery = {"max_ejected_fraction": 1.0}
    async with make_stack(engine=QUICK_TIMEOUTS, recovery=recovery) as stack:
        hold_readmission(stack)
        await fail_run(stack, "p0", "prefill", {"status": 500}, count=3)
        assert (await engine_state(stack, "p0", "ejected"))["state"] == "ejected"
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 200
        line = (await stack.journal(4, kind="request"))[-1]
        assert line["handoff"] == "fallback" and line["panic"] is False

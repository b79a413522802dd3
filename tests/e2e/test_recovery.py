"""The breaker ejects failing engines; readmission lets back only engines that work."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from narwhal.engines.probe import PROBE_PROMPT
from narwhal.fleet.lifecycle import Event
from narwhal.fleet.readmission import Verdict
from narwhal.fleet.table import Engine
from narwhal.protocol.errors import Cause, engine_error
from support.stack import (
    COMPLETION,
    CONTRACT,
    Stack,
    StackFactory,
    arm,
    engine_state,
    hold_readmission,
    router_state,
    settled,
)

STREAM = {**COMPLETION, "stream": True}
# One engine per phase: the breaker may eject the last of a phase here.
QUICK = {"eject_after": 2, "readmit_interval_s": 0.1, "max_ejected_fraction": 1.0}
SLOW = {"eject_after": 2, "readmit_interval_s": 60.0, "max_ejected_fraction": 1.0}


async def fail_decodes(stack: Stack, engine: str, count: int) -> None:
    arm(stack.engine(engine), phase="decode", status=500, times=count)
    for _ in range(count):
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 502


async def test_consecutive_failures_eject_with_the_reason_visible(
    make_stack: StackFactory,
) -> None:
    async with make_stack(recovery=SLOW) as stack:
        hold_readmission(stack)
        await fail_decodes(stack, "d0", 2)
        d0 = await engine_state(stack, "d0", "ejected")
        assert d0["state"] == "ejected" and d0["streak"] == 2 and d0["ejections"] == 1
        assert d0["ejection_reason"].startswith("2 consecutive failures; last: http_status")
        # The last consumer is out, yet it accepts connections: panic placement uses it.
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 200
        assert (await stack.journal(3, kind="request"))[-1]["panic"] is True


async def test_a_success_resets_the_streak(make_stack: StackFactory) -> None:
    async with make_stack(recovery=SLOW) as stack:
        await fail_decodes(stack, "d0", 1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        await fail_decodes(stack, "d0", 1)
        d0 = await engine_state(stack, "d0", "admitted")
        assert d0["state"] == "admitted" and d0["streak"] == 1


async def test_placement_routes_around_an_ejected_engine(make_stack: StackFactory) -> None:
    roles = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    # Without releases of the refused decodes' handoffs: they go out in the background, and
    # one sent to d0 may arrive while the requests below are counted.
    engine = {"release_abandoned": False}
    async with make_stack(roles, recovery=SLOW, engine=engine) as stack:
        arm(stack.engine("d0"), phase="decode", status=500)
        arm(stack.engine("d1"), phase="decode", status=500, times=1)
        for _ in range(3):
            await stack.post("/v1/completions", COMPLETION)
        assert (await engine_state(stack, "d0", "ejected"))["state"] == "ejected"
        before = len(stack.engine("d0").received)
        for _ in range(4):
            assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        assert len(stack.engine("d0").received) == before


async def test_ejection_does_not_cut_requests_already_running(make_stack: StackFactory) -> None:
    roles = (("p0", "prefill"), ("d0", "decode"))
    async with make_stack(roles, recovery=SLOW, sim={"inter_token_s": 0.02}) as stack:
        running = asyncio.create_task(stack.post("/v1/completions", {**STREAM, "max_tokens": 40}))
        await asyncio.sleep(0.15)
        router = stack.server.router
        router.fleet.by_id["d0"].streak = 5
        router.breaker.failure(engine_error(Cause.SILENCE, "went quiet", "d0"))
        assert router.fleet.by_id["d0"].ejected
        status, text = await running
        assert status == 200 and "error" not in text and text.endswith("data: [DONE]\n\n")


async def test_a_recovered_consumer_is_probed_through_its_original_producer(
    make_stack: StackFactory,
) -> None:
    async with make_stack(recovery=QUICK) as stack:
        arm(stack.engine("d0"), phase="decode", status=500, times=2)
        for _ in range(2):
            await stack.post("/v1/completions", COMPLETION)
        d0 = await engine_state(stack, "d0", "admitted")
        assert d0["state"] == "admitted" and d0["probes"]["success"] >= 1
        probe_prefills = [
            r for r in stack.engine("p0").received if r.body.get("prompt") == PROBE_PROMPT
        ]
        assert probe_prefills and probe_prefills[0].body["kv_transfer_params"]["do_remote_decode"]
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        lines = await stack.journal(6)
        kinds = {line["event"] for line in lines if line["type"] == "engine"}
        assert {"ejected", "probe", "readmitted"} <= kinds, lines
        await settled(stack)


async def test_an_engine_that_still_fails_stays_out(make_stack: StackFactory) -> None:
    async with make_stack(recovery=QUICK) as stack:
        arm(stack.engine("d0"), phase="decode", status=500)
        for _ in range(2):
            await stack.post("/v1/completions", COMPLETION)
        await asyncio.sleep(0.5)
        d0 = await engine_state(stack, "d0", "ejected")
        assert d0["state"] == "ejected" and d0["probes"]["failure"] >= 2
        assert "success" not in d0["probes"]


async def test_a_probe_without_its_producer_is_inconclusive(make_stack: StackFactory) -> None:
    async with make_stack(recovery=QUICK) as stack:
        await fail_decodes(stack, "d0", 2)
        # Ejected behind the listeners' backs: readmission finds it at its next tick.
        stack.server.router.fleet.by_id["p0"].lifecycle.apply(Event.EJECT, lambda _: None)
        await stack.engine("p0").crash()
        await asyncio.sleep(0.5)
        d0 = await engine_state(stack, "d0", "ejected")
        assert d0["probes"].get("inconclusive", 0) >= 2
        assert "failure" not in d0["probes"] and "success" not in d0["probes"]


async def test_a_restart_with_the_same_contract_may_return(make_stack: StackFactory) -> None:
    async with make_stack(recovery=QUICK, engine_contract=CONTRACT) as stack:
        old_id = stack.engine("d0").engine_id
        await fail_decodes(stack, "d0", 2)
        await stack.engine("d0").restart()
        assert stack.engine("d0").engine_id != old_id
        d0 = await engine_state(stack, "d0", "admitted")
        assert d0["state"] == "admitted"


async def test_a_restart_with_a_different_contract_stays_out(make_stack: StackFactory) -> None:
    async with make_stack(recovery=QUICK, engine_contract=CONTRACT) as stack:
        await fail_decodes(stack, "d0", 2)
        engine = stack.engine("d0")
        engine.options = replace(engine.options, version="0.12.0")
        await engine.restart()
        await asyncio.sleep(0.4)
        d0 = await engine_state(stack, "d0", "ejected")
        assert d0["state"] == "ejected"
        assert d0["ejection_reason"] == (
            "contract mismatch: engine_version: expected '0.11.0', got '0.12.0'"
        )
        # Not even panic placement sends work to an engine that breaks the contract.
        status, body = await stack.post("/v1/completions", COMPLETION)
        assert status == 503 and body["error"]["message"] == (
            "no engine can decode: none of the 1 is admitted (1 break the engine contract)"
        )


async def test_a_contract_pinning_only_the_version_readmits_a_restarted_engine(
    make_stack: StackFactory,
) -> None:
    contract = {"engine_version": CONTRACT["engine_version"]}
    async with make_stack(recovery=QUICK, engine_contract=contract) as stack:
        await fail_decodes(stack, "d0", 2)
        await stack.engine("d0").restart()
        d0 = await engine_state(stack, "d0", "admitted")
        assert d0["state"] == "admitted" and d0["probes"]["success"] >= 1
        state = await router_state(stack)
        assert state["engine_contract"] == contract


WAVE = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("d2", "decode"))


async def test_a_whole_wave_returns_together(make_stack: StackFactory) -> None:
    recovery = {**QUICK, "eject_after": 1, "restart_policy": "whole_wave"}
    async with make_stack(WAVE, recovery=recovery) as stack:
        router = stack.server.router
        for name in ("d0", "d1"):
            arm(stack.engine(name), phase="decode", status=500)
        await _eject(stack, "d0")
        await _eject(stack, "d1")
        stack.engine("d1").clear_faults()
        d1 = await engine_state(stack, "d1", "held")
        assert d1["state"] == "held"
        assert (await engine_state(stack, "d0", "ejected"))["state"] == "ejected"
        assert router.fleet.by_id["d2"].state(asyncio.get_running_loop().time()) == "admitted"
        stack.engine("d0").clear_faults()
        assert (await engine_state(stack, "d0", "admitted"))["state"] == "admitted"
        assert (await engine_state(stack, "d1", "admitted"))["state"] == "admitted"


async def test_held_engines_return_early_rather_than_leave_a_phase_empty(
    make_stack: StackFactory,
) -> None:
    roles = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    recovery = {**QUICK, "eject_after": 1, "restart_policy": "whole_wave"}
    async with make_stack(roles, recovery=recovery) as stack:
        for name in ("d0", "d1"):
            arm(stack.engine(name), phase="decode", status=500)
        await _eject(stack, "d0")
        await _eject(stack, "d1")
        stack.engine("d1").clear_faults()
        assert (await engine_state(stack, "d1", "admitted"))["state"] == "admitted"
        assert (await engine_state(stack, "d0", "ejected"))["state"] == "ejected"
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200


async def _eject(stack: Stack, name: str) -> None:
    """Send requests until `name` has been ejected (placement picks by load)."""
    for _ in range(10):
        state = await router_state(stack)
        if next(e for e in state["engines"] if e["id"] == name)["state"] != "admitted":
            return
        await stack.post("/v1/completions", COMPLETION)
    raise AssertionError(f"{name} was never ejected")


async def test_a_probe_that_breaks_unexpectedly_is_inconclusive_and_readmission_goes_on(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_stack(recovery=QUICK) as stack:
        await fail_decodes(stack, "d0", 2)
        readmission = stack.server.router.readmission
        calls = 0
        judge = readmission.judge

        async def flaky(engine: Engine) -> Verdict:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("unforeseen")
            return await judge(engine)

        monkeypatch.setattr(readmission, "judge", flaky)
        d0 = await engine_state(stack, "d0", "admitted")
        assert d0["state"] == "admitted"
        assert d0["probes"]["inconclusive"] >= 1 and d0["probes"]["success"] >= 1

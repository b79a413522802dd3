"""The role controller over simulated engines, real router, real sockets.

Four engines of role `both`: one starts as prefill, three as decode, one of them pinned.
Long prompts against a slow prefill and a tight TTFT objective make prefill the pressured
phase; with a fast interval the controller moves one unpinned decode engine to prefill.
Streaming clients run throughout: no request may fail, the requests running on the moved
engine included, and the journal, `/narwhal/state` and `/metrics` name the move and why.
In advisory mode the same pressure journals the move as advice and changes nothing.
Under deep overload (the producer's queue past a short KV lease, handoffs expiring) the
requests still waiting are the evidence, and the split moves toward prefill.
"""

from __future__ import annotations

import asyncio
from typing import Any

from support.stack import MODEL, StackFactory

ROLES = (("a", "both"), ("b", "both"), ("c", "both"), ("d", "both"))
START = {
    "a": {"start_as": "prefill"},
    "b": {"start_as": "decode"},
    "c": {"start_as": "decode"},
    "d": {"start_as": "decode", "pin": True},
}
PROMPT = " ".join(f"tide{i}" for i in range(300))
WAIT_S = 120.0  # generous: a busy 2-core machine; nothing here is timed tightly


SIM = {"prefill_s_per_token": 0.0005, "inter_token_s": 0.004}
CONTROLLER = {
    "enabled": True,
    "interval_s": 0.3,
    "window_s": 10.0,
    "dwell_s": 0.0,
    "cooldown_s": 600.0,
    "min_samples": 5,
}
SLO = {"ttft_s": 0.02, "tpot_s": 0.5}


async def test_prefill_pressure_moves_one_engine_to_prefill(make_stack: StackFactory) -> None:
    async with make_stack(
        ROLES, engine_keys=START, sim=SIM, controller=CONTROLLER, slo=SLO
    ) as stack:
        failures: list[str] = []
        done = 0
        stop = asyncio.Event()

        async def client(index: int) -> None:
            nonlocal done
            while not stop.is_set():
                body = {
                    "model": MODEL,
                    "prompt": f"{index} {done} {PROMPT}",
                    "max_tokens": 30,
                    "stream": True,
                }
                try:
                    async with stack.http.post(stack.url + "/v1/completions", json=body) as r:
                        text = (await r.read()).decode()
                        if r.status != 200 or '"error"' in text or "[DONE]" not in text:
                            failures.append(f"{r.status}: {text[-200:]}")
                        else:
                            done += 1
                except Exception as error:  # every failure is recorded
                    failures.append(repr(error))

        clients = [asyncio.create_task(client(i)) for i in range(6)]
        try:
            state = await _until(stack, lambda s: s["controller"]["moves"] or None)
            # Requests keep completing after the move, on the new split.
            after = done
            await _until(stack, lambda _: done >= after + 20)
        finally:
            stop.set()
            await asyncio.gather(*clients)
        assert failures == []
        assert done >= after + 20

        controller = state["controller"]
        assert controller["enabled"] is True and controller["advisory"] is False
        assert controller["moves"] == {"ttft_pressure": 1}
        move = controller["timeline"][0]
        assert (move["from"], move["to"], move["reason"]) == ("decode", "prefill", "ttft_pressure")
        moved = move["engine"]
        assert moved in ("b", "c")
        final = await (await stack.http.get(stack.url + "/narwhal/state")).json()
        acting = {e["id"]: e["acting"] for e in final["engines"]}
        assert acting["d"] == "decode"  # pinned
        assert acting[moved] == "prefill"
        assert final["controller"]["split"] == {"prefill": 2, "decode": 2, "both": 0}
        # Every seat is free again: requests on the moved engine finished there.
        for engine in final["engines"]:
            assert engine["seats"]["prefill"]["in_use"] == 0
            assert engine["seats"]["decode"]["in_use"] == 0

        events = await stack.journal(kind="engine")
        change = next(line for line in events if line["event"] == "role_change")
        assert change["engine"] == moved and change["reason"] == "ttft_pressure"
        assert change["inputs"]["ttft_p90_s"] > 0.02
        assert "decode -> prefill" in change["detail"]
        requests = await stack.journal(kind="request")
        assert any(line["producer"] == moved for line in requests)

        metrics = await (await stack.http.get(stack.url + "/metrics")).text()
        role = f'narwhal_engine_role{{engine="{moved}",model="{MODEL}",role="prefill"}} 1.0'
        assert role in metrics
        assert 'narwhal_controller_moves_total{reason="ttft_pressure"} 1.0' in metrics


async def _until(stack: Any, check: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        async with stack.http.get(stack.url + "/narwhal/state") as response:
            state: dict[str, Any] = await response.json()
        if check(state):
            return state
        if loop.time() > deadline:
            raise AssertionError(f"no move in {WAIT_S} s: {state['controller']}")
        await asyncio.sleep(0.2)


async def test_advisory_mode_journals_the_move_and_changes_nothing(
    make_stack: StackFactory,
) -> None:
    async with make_stack(
        ROLES,
        engine_keys=START,
        sim=SIM,
        controller={**CONTROLLER, "advisory": True},
        slo=SLO,
    ) as stack:
        failures: list[str] = []
        stop = asyncio.Event()

        async def client(index: int) -> None:
            sent = 0
            while not stop.is_set():
                sent += 1
                body = {"model": MODEL, "prompt": f"{index} {sent} {PROMPT}", "max_tokens": 30}
                async with stack.http.post(stack.url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        failures.append(f"{r.status}: {(await r.read())[-200:]!r}")
                    await r.read()

        clients = [asyncio.create_task(client(i)) for i in range(6)]
        try:
            state = await _until(stack, lambda s: s["controller"]["advice"] or None)
        finally:
            stop.set()
            await asyncio.gather(*clients)
        assert failures == []
        controller = state["controller"]
        assert controller["advisory"] is True and controller["moves"] == {}
        assert controller["advice"] == {"ttft_pressure": 1}
        advice = controller["timeline"][0]
        assert advice["applied"] is False and advice["to"] == "prefill"
        final = await (await stack.http.get(stack.url + "/narwhal/state")).json()
        acting = {e["id"]: e["acting"] for e in final["engines"]}
        assert acting == {"a": "prefill", "b": "decode", "c": "decode", "d": "decode"}
        events = await stack.journal(kind="engine")
        assert not [line for line in events if line["event"] == "role_change"]
        line = next(line for line in events if line["event"] == "role_advice")
        assert line["engine"] == advice["engine"] and line["reason"] == "ttft_pressure"
        assert line["inputs"]["ttft_p90_s"] > 0.02
        metrics = await (await stack.http.get(stack.url + "/metrics")).text()
        assert 'narwhal_controller_advice_total{reason="ttft_pressure"} 1.0' in metrics
        assert "narwhal_controller_moves_total{" not in metrics or (
            'narwhal_controller_moves_total{reason="ttft_pressure"} 0.0' in metrics
        )


async def test_a_prefill_queue_past_the_kv_lease_still_moves_engines(
    make_stack: StackFactory,
) -> None:
    """Deep overload: the one producer's queue grows past the KV lease, so its handoffs
    expire (504 handoff_expired) and hardly a request reaches its first token. The
    requests still waiting are the evidence: the split moves toward prefill all the same."""
    lease_s = 1.2  # the descriptor bound is a sixth less: 1 s
    # No engine may move in the first 6 s: by then the producer's queue is past the lease.
    controller = {**CONTROLLER, "dwell_s": 6.0, "cooldown_s": 2.0, "window_s": 5.0}
    async with make_stack(
        (("a", "both"), ("b", "both"), ("c", "both"), ("d", "both")),
        engine_keys={**START, "d": {"start_as": "decode"}},
        sim={**SIM, "prefill_s_per_token": 0.001, "kv_lease_s": lease_s},
        controller=controller,
        slo={"ttft_s": 0.25, "tpot_s": 0.5},
        engine={"kv_lease_s": lease_s},
        recovery={"eject_after": 1_000_000},
    ) as stack:
        statuses: list[int] = []
        stop = asyncio.Event()

        async def client(index: int) -> None:
            sent = 0
            while not stop.is_set():
                sent += 1
                body = {"model": MODEL, "prompt": f"{index} {sent} {PROMPT}", "max_tokens": 4}
                async with stack.http.post(stack.url + "/v1/completions", json=body) as r:
                    await r.read()
                    statuses.append(r.status)

        clients = [asyncio.create_task(client(i)) for i in range(16)]
        try:
            state = await _until(stack, lambda s: len(s["controller"]["timeline"]) >= 2 or None)
        finally:
            stop.set()
            await asyncio.gather(*clients)
        timeline = state["controller"]["timeline"]
        assert [(t["from"], t["to"]) for t in timeline[:2]] == [("decode", "prefill")] * 2
        assert state["controller"]["split"]["prefill"] >= 3
        events = await stack.journal(kind="engine")
        first = next(line for line in events if line["event"] == "role_change")
        # Taken on requests without a first token, beside a decode phase nothing reached.
        assert first["inputs"]["prefill_pending"] >= CONTROLLER["min_samples"]
        requests = await stack.journal(kind="request")
        before = [line for line in requests if line["ts"] < first["ts"]]
        assert any(line["cause"] == "handoff_expired" for line in before), statuses

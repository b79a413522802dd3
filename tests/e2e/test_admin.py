"""The admin API over real sockets: its guard, its answers, and what state and metrics show."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from narwhal.config.secrets import Secrets
from narwhal.tools.sim.fleet import SimFleet
from support.stack import COMPLETION, FAST, MODEL, Stack, StackFactory, router_state, settled

ADMIN_KEY = "sk-admin-1111111111"
CLIENT_KEY = "sk-client-2222222222"
SECRETS = Secrets(client_keys=(CLIENT_KEY.encode(),), admin_keys=(ADMIN_KEY.encode(),))
FOUR = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def call(
    stack: Stack, method: str, path: str, body: Any = None, headers: dict[str, str] = ADMIN
) -> tuple[int, Any]:
    async with stack.http.request(method, stack.url + path, json=body, headers=headers) as response:
        return response.status, await response.json()


async def test_every_admin_route_needs_the_admin_key(make_stack: StackFactory) -> None:
    routes = [
        ("POST", "/narwhal/engines"),
        ("POST", "/narwhal/engines/d0/drain"),
        ("POST", "/narwhal/engines/d0/readmit"),
        ("PATCH", "/narwhal/engines/d0"),
        ("DELETE", "/narwhal/engines/d0"),
        ("POST", "/narwhal/reload"),
    ]
    async with make_stack(FOUR, secrets=SECRETS) as stack:
        for method, path in routes:
            for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}):
                status, body = await call(stack, method, path, {"pin": True}, headers)
                assert status == 401 and body["error"]["code"] == 401, (method, path)
        assert (await router_state_with_key(stack))["engines"][2]["state"] == "admitted"


async def router_state_with_key(stack: Stack) -> dict[str, Any]:
    async with stack.http.get(stack.url + "/narwhal/state", headers=ADMIN) as response:
        state: dict[str, Any] = await response.json()
        return state


async def test_refusals_are_clear_json_errors(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        status, body = await call(stack, "POST", "/narwhal/engines/nope/drain")
        assert status == 404 and body["error"]["message"] == "no engine 'nope' in the fleet"
        status, body = await call(stack, "POST", "/narwhal/engines/d0/drain")
        assert status == 409
        assert "no admitted engine to decode" in body["error"]["message"]
        assert "?force=true" in body["error"]["message"]
        status, body = await call(stack, "DELETE", "/narwhal/engines/d0")
        assert status == 409 and "drain it first" in body["error"]["message"]
        status, body = await call(stack, "POST", "/narwhal/engines/d0/readmit")
        assert status == 409 and "not drained" in body["error"]["message"]
        entry = {"id": "d9", "url": "http://127.0.0.1:1", "role": "decoder", "max_seats": 2}
        status, body = await call(stack, "POST", "/narwhal/engines", entry)
        assert status == 400 and body["error"]["param"] == "role"
        assert body["error"]["problems"] == [
            'role: must be one of "prefill", "decode", "both", got "decoder"',
            'max_seats: unknown key (did you mean "max_decode_seats"?)',
        ]
        async with stack.http.post(
            stack.url + "/narwhal/engines", data=b"{nope", headers=ADMIN
        ) as response:
            assert response.status == 400
            assert "not valid JSON" in (await response.json())["error"]["message"]
        status, body = await call(stack, "PATCH", "/narwhal/engines/d0", {"max_decode_seats": -1})
        assert status == 400 and body["error"]["param"] == "max_decode_seats"
        status, body = await call(stack, "POST", "/narwhal/reload")
        assert status == 409 and "not started from a config file" in body["error"]["message"]
        # Nothing changed, and the fleet still serves.
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        state = await settled(stack)
        assert [e["state"] for e in state["engines"]] == ["admitted", "admitted"]


async def test_drain_delete_add_and_patch_show_in_state_metrics_and_the_journal(
    make_stack: StackFactory,
) -> None:
    async with make_stack(FOUR) as stack, SimFleet([replace(FAST, name="d9")]) as spare:
        extra = spare.engines[0]
        status, body = await call(stack, "POST", "/narwhal/engines/d1/drain")
        assert status == 200 and body["engine"]["state"] == "drained"
        for _ in range(4):
            assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        assert len(stack.engine("d1").received) == 0
        status, body = await call(stack, "DELETE", "/narwhal/engines/d1")
        assert status == 200 and body == {"removed": "d1"}
        entry = {"id": "d9", "url": extra.url, "role": "decode", "max_decode_seats": 4}
        status, body = await call(stack, "POST", "/narwhal/engines", entry)
        # Out of placement until readmission has probed it, which it does at once.
        assert status == 201 and body["engine"]["state"] == "ejected"
        assert body["engine"]["seats"]["decode"]["limit"] == 4
        for _ in range(300):
            state = await router_state(stack)
            if next(e for e in state["engines"] if e["id"] == "d9")["state"] == "admitted":
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"d9 not admitted after its probe: {state}")
        status, body = await call(stack, "POST", "/narwhal/engines", entry)
        assert status == 409 and body["error"]["param"] == "id"
        status, body = await call(stack, "PATCH", "/narwhal/engines/p1", {"pin": True})
        assert status == 200 and body["engine"]["pinned"] is True

        state = await router_state(stack)
        assert [e["id"] for e in state["engines"]] == ["p0", "p1", "d0", "d9"]
        async with stack.http.get(stack.url + "/metrics") as response:
            metrics = await response.text()
        assert 'engine="d1"' not in metrics
        model = f'model="{MODEL}"'
        assert f'narwhal_engine_info{{engine="d9",{model},role="decode"' in metrics
        assert f'narwhal_engine_state{{engine="d9",{model},state="drained"}} 0.0' in metrics

        events = [(line["event"], line["engine"]) for line in await stack.journal(7, kind="engine")]
        assert events == [
            ("draining", "d1"),
            ("drained", "d1"),
            ("removed", "d1"),
            ("added", "d9"),
            ("probe", "d9"),
            ("readmitted", "d9"),
            ("changed", "p1"),
        ]
        assert len(await stack.journal(4, kind="request")) == 4


async def test_a_forced_drain_of_the_last_producer_leaves_fallback_serving(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        status, body = await call(stack, "POST", "/narwhal/engines/p0/drain?force=true")
        assert status == 200 and body["engine"]["state"] == "drained"
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        (line,) = await stack.journal(1, kind="request")
        assert line["handoff"] == "fallback"
        async with stack.http.get(stack.url + "/health") as response:
            assert (await response.json())["status"] == "degraded"
        status, _ = await call(stack, "POST", "/narwhal/engines/p0/readmit")
        assert status == 200
        async with stack.http.get(stack.url + "/health") as response:
            assert (await response.json())["status"] == "ok"

"""The request owns its seats, retries, handoff age and cleanup, on every path."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from support.stack import COMPLETION, StackFactory, arm, settled, terminal_error

STREAM = {**COMPLETION, "stream": True}
TWO_PRODUCERS = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
TWO_CONSUMERS = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))


async def state_of(stack: Any) -> dict[str, Any]:
    async with stack.http.get(stack.url + "/narwhal/state") as response:
        result: dict[str, Any] = await response.json()
        return result


async def test_state_shows_engines_seats_queue_and_budget(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        state = await state_of(stack)
        assert [e["id"] for e in state["engines"]] == ["p0", "d0"]
        p0 = state["engines"][0]
        assert p0["role"] == "prefill" and p0["state"] == "admitted"
        assert p0["seats"]["prefill"] == {"in_use": 0, "limit": 64, "share": 64}
        assert state["queued"] == 0 and state["retry_budget"]["credit"] == 10


async def test_a_request_holds_its_decode_seat_until_the_stream_ends(
    make_stack: StackFactory,
) -> None:
    async with make_stack(sim={"inter_token_s": 0.02}) as stack:
        task = asyncio.create_task(stack.post("/v1/completions", {**STREAM, "max_tokens": 30}))
        for _ in range(100):
            state = await state_of(stack)
            if state["engines"][1]["seats"]["decode"]["in_use"]:
                break
            await asyncio.sleep(0.01)
        assert state["engines"][1]["seats"]["decode"]["in_use"] == 1
        assert state["engines"][0]["seats"]["prefill"]["in_use"] == 0
        status, _ = await task
        assert status == 200
        await settled(stack)


async def test_without_a_free_seat_requests_wait_in_arrival_order(
    make_stack: StackFactory, tmp_path: Any
) -> None:
    async with make_stack(sim={"inter_token_s": 0.01}) as stack:
        await _limit_decode_seats(stack, 1)
        bodies = [{**STREAM, "max_tokens": 10, "prompt": f"request {i}"} for i in range(4)]
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(stack.post("/v1/completions", body)))
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*tasks)
        assert [status for status, _ in results] == [200] * 4
        decodes = [r.body["prompt"] for r in stack.engine("d0").received]
        assert decodes == [b["prompt"] for b in bodies]
        await settled(stack)


async def _limit_decode_seats(stack: Any, limit: int) -> None:
    """Seats are configured per engine; tests lower them on the live fleet object."""
    from dataclasses import replace

    for engine in stack.server.router.fleet.engines:
        engine.spec = replace(engine.spec, max_decode_seats=limit)


async def test_a_full_queue_is_429_with_retry_after(make_stack: StackFactory) -> None:
    async with make_stack(serving={"queue_capacity": 1}, sim={"inter_token_s": 0.02}) as stack:
        await _limit_decode_seats(stack, 1)
        first = asyncio.create_task(stack.post("/v1/completions", {**STREAM, "max_tokens": 20}))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(stack.post("/v1/completions", STREAM))
        await asyncio.sleep(0.05)
        async with stack.http.post(stack.url + "/v1/completions", json=STREAM) as response:
            assert response.status == 429
            assert response.headers["Retry-After"] == "1"
            body = await response.json()
        assert "queue is full" in body["error"]["message"]
        assert [s for s, _ in await asyncio.gather(first, second)] == [200, 200]
        await settled(stack)


async def test_waiting_longer_than_the_queue_timeout_is_503(make_stack: StackFactory) -> None:
    async with make_stack(serving={"queue_timeout_s": 0.2}, sim={"inter_token_s": 0.05}) as stack:
        await _limit_decode_seats(stack, 1)
        first = asyncio.create_task(stack.post("/v1/completions", {**STREAM, "max_tokens": 20}))
        await asyncio.sleep(0.05)
        status, body = await stack.post("/v1/completions", STREAM)
        assert status == 503
        assert "no seat became free within 0.2 s" in body["error"]["message"]
        assert (await first)[0] == 200
        await settled(stack)


async def test_a_deadline_that_passes_in_the_queue_is_504(make_stack: StackFactory) -> None:
    async with make_stack(
        engine={
            "prefill_timeout_s": 0.3,
            "first_token_timeout_s": 0.3,
            "decode_read_timeout_s": 0.3,
        },
        serving={"request_timeout_s": 0.3, "queue_timeout_s": 0.3},
    ) as stack:
        await _limit_decode_seats(stack, 1)
        occupied = stack.server.router.fleet.try_reserve()
        assert occupied is not None
        status, body = await stack.post("/v1/completions", STREAM)
        assert status == 504
        assert "while waiting for a seat" in body["error"]["message"]
        occupied.release()
        await settled(stack)


async def test_a_client_that_leaves_the_queue_takes_no_seat(make_stack: StackFactory) -> None:
    async with make_stack(sim={"inter_token_s": 0.02}) as stack:
        await _limit_decode_seats(stack, 1)
        first = asyncio.create_task(stack.post("/v1/completions", {**STREAM, "max_tokens": 15}))
        await asyncio.sleep(0.05)
        with contextlib.suppress(TimeoutError):
            await stack.http.post(
                stack.url + "/v1/completions",
                json=STREAM,
                timeout=aiohttp.ClientTimeout(total=0.1),
            )
        assert (await first)[0] == 200
        await settled(stack)
        lines = await stack.journal(2)
        assert sorted(line["status"] for line in lines) == [200, 499]


async def test_a_quarantined_last_consumer_still_serves_by_panic_placement(
    make_stack: StackFactory,
) -> None:
    async with make_stack(recovery={"failure_quarantine_s": 5.0}) as stack:
        arm(stack.engine("d0"), phase="decode", status=500, times=1)
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 502
        state = await state_of(stack)
        assert state["engines"][1]["state"] == "quarantined" and state["degraded"]
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 200
        lines = await stack.journal(2, kind="request")
        assert [line["panic"] for line in lines] == [False, True]
        assert (await state_of(stack))["engines"][1]["panic_placements"] == 1


async def test_no_consumer_that_accepts_connections_is_503_naming_the_phase(
    make_stack: StackFactory,
) -> None:
    async with make_stack(recovery={"failure_quarantine_s": 5.0}) as stack:
        await stack.engine("d0").crash()
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 502
        async with stack.http.post(stack.url + "/v1/completions", json=COMPLETION) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1"
            body = await response.json()
        assert body["error"]["message"] == (
            "no engine can decode: none of the 1 is admitted (1 refuse connections)"
        )


async def test_a_transient_fault_retries_on_another_engine_with_fresh_ids(
    make_stack: StackFactory,
) -> None:
    async with make_stack(TWO_PRODUCERS, serving={"max_attempts": 2}) as stack:
        for name in ("p0", "p1"):
            arm(stack.engine(name), phase="prefill", status=503, times=1)
        status, _ = await stack.post("/v1/completions", COMPLETION)
        # Both producers failed once; the second attempt avoided the first one's engine.
        assert status == 502
        (line,) = await stack.journal()
        assert line["attempts"] == 2
        assert {len(stack.engine(n).received) for n in ("p0", "p1")} == {1}
        first, second = line["backend_request_ids"]
        assert first != second
        await settled(stack)


async def test_a_retry_gets_a_new_handoff_after_a_decode_failure(
    make_stack: StackFactory,
) -> None:
    async with make_stack(TWO_CONSUMERS, serving={"max_attempts": 3}) as stack:
        arm(stack.engine("d0"), phase="decode", error_after=0, error_code=503, times=1)
        arm(stack.engine("d1"), phase="decode", error_after=0, error_code=503, times=1)
        status, _ = await stack.post("/v1/completions", STREAM)
        assert status == 200
        (line,) = await stack.journal()
        assert line["attempts"] == 3
        prefills = list(stack.engine("p0").received)
        assert len(prefills) == 3
        assert len({r.request_id for r in prefills}) == 3
        state = await settled(stack)
        assert state["retry_budget"]["spent"] == 2


async def test_an_empty_budget_stops_retries(make_stack: StackFactory) -> None:
    async with make_stack(TWO_PRODUCERS, serving={"max_attempts": 3, "retry_budget": 0}) as stack:
        arm(stack.engine("p0"), phase="prefill", status=503, times=1)
        arm(stack.engine("p1"), phase="prefill", status=503, times=1)
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 502
        (line,) = await stack.journal()
        assert line["attempts"] == 1 and line["retry_denied"] is True


async def test_a_clients_own_4xx_is_never_retried(make_stack: StackFactory) -> None:
    async with make_stack(
        TWO_PRODUCERS, serving={"max_attempts": 3}, sim={"max_model_len": 32}
    ) as stack:
        status, _ = await stack.post("/v1/completions", {**COMPLETION, "prompt": "w " * 64})
        assert status == 400
        (line,) = await stack.journal()
        assert line["attempts"] == 1


async def test_no_retry_once_output_is_visible(make_stack: StackFactory) -> None:
    async with make_stack(TWO_CONSUMERS, serving={"max_attempts": 3}) as stack:
        arm(stack.engine("d0"), phase="decode", error_after=2, error_code=503)
        arm(stack.engine("d1"), phase="decode", error_after=2, error_code=503)
        status, text = await stack.post("/v1/completions", STREAM)
        assert status == 200 and terminal_error(text)["code"] == 503
        (line,) = await stack.journal()
        assert line["attempts"] == 1
        await settled(stack)


async def test_an_expired_handoff_is_never_decoded(make_stack: StackFactory) -> None:
    async with make_stack(engine={"kv_lease_s": 0.6, "prefill_timeout_s": 2.0}) as stack:
        arm(stack.engine("p0"), phase="prefill", hang_s=0.55)
        status, body = await stack.post("/v1/completions", STREAM)
        assert status == 504
        assert body["error"]["message"].startswith("handoff expired")
        assert len(stack.engine("d0").received) == 0
        await settled(stack)

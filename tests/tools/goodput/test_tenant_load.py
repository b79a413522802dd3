"""The multi-tenant load sends each tenant's requests with its key, as it shapes them, and
records what each got: a stream's tokens and usage, a refusal and its Retry-After, a return."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from narwhal.tools.goodput.tenant_load import drive
from narwhal.tools.goodput.tenants import parse_tenant


class Router:
    """A stand-in router: streams `max_tokens` token events and a usage event, or, for the
    key `sk-limited`, refuses every other request with 429 and `Retry-After: 0`; for the key
    `sk-never` every request, with `Retry-After: 30`."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.bodies: list[dict[str, object]] = []
        self.refuse_next = True

    async def completions(self, request: web.Request) -> web.StreamResponse:
        key = request.headers["Authorization"].removeprefix("Bearer ")
        body = orjson.loads(await request.read())
        self.keys.append(key)
        self.bodies.append(body)
        if key == "sk-never":
            return web.json_response({}, status=429, headers={"Retry-After": "30"})
        if key == "sk-limited":
            self.refuse_next = not self.refuse_next
            if not self.refuse_next:
                return web.json_response(
                    {"error": {"code": "rate_limit_exceeded"}},
                    status=429,
                    headers={"Retry-After": "0"},
                )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        tokens = int(body["max_tokens"])
        for _ in range(tokens):
            await response.write(b'data: {"choices":[{"index":0,"text":" word"}]}\n\n')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}
        await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
async def router() -> AsyncIterator[tuple[Router, str]]:
    fake = Router()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_open_and_closed_loop_tenants_send_with_their_keys(
    router: tuple[Router, str],
) -> None:
    fake, url = router
    tenants = [
        parse_tenant("open:rate=40,arrivals=fixed,prompt_tokens=7,max_tokens=3"),
        parse_tenant("closed:concurrency=2,prompt_tokens=5,max_tokens=4,key=k2"),
    ]
    records = await drive(url, tenants, duration_s=0.5, model="m")
    opened = [r for r in records if r.tenant == "open"]
    closed = [r for r in records if r.tenant == "closed"]
    assert len(opened) == 20  # 40/s for 0.5 s, evenly spaced
    assert len(closed) >= 2
    assert all(r.ok and r.status == 200 for r in records)
    assert {(r.prompt_tokens, r.completion_tokens) for r in opened} == {(7, 3)}
    assert {(r.prompt_tokens, r.completion_tokens) for r in closed} == {(5, 4)}
    assert all(r.ttft_s is not None and r.ttft_s >= 0 for r in records)
    assert set(fake.keys) == {"sk-open", "k2"}
    body = fake.bodies[0]
    assert body["stream"] is True and body["model"] == "m"
    assert body["stream_options"] == {"include_usage": True}


async def test_a_client_honouring_retry_after_sends_the_same_request_again(
    router: tuple[Router, str],
) -> None:
    fake, url = router
    # Three requests (at 0, 0.1 and 0.2 s); their returns may come until the run's end.
    tenant = parse_tenant(
        "limited:rate=10,arrivals=fixed,stop_s=0.25,key=sk-limited,retry_after=true"
    )
    records = await drive(url, [tenant], duration_s=2.0, model="m")
    refused = [r for r in records if r.refused]
    returns = [r for r in records if r.returned]
    assert len(refused) == 3 and all(r.retry_after_s == 0 for r in refused)
    assert len(returns) == 3 and all(r.ok for r in returns)
    # Each return carried its refused request's very body.
    prompts = {orjson.dumps(body["prompt"]) for body in fake.bodies}
    assert len(prompts) == 3


async def test_a_client_not_honouring_retry_after_does_not_come_back(
    router: tuple[Router, str],
) -> None:
    _, url = router
    tenant = parse_tenant("limited:rate=10,arrivals=fixed,key=sk-limited")
    records = await drive(url, [tenant], duration_s=0.3, model="m")
    assert sum(r.refused for r in records) >= 1
    assert not any(r.returned for r in records)


async def test_a_closed_loop_waits_out_a_retry_after_past_the_runs_end_rather_than_spin(
    router: tuple[Router, str],
) -> None:
    _, url = router
    honours = parse_tenant("honours:concurrency=1,key=sk-never,retry_after=true")
    records = await drive(url, [honours], duration_s=0.3, model="m")
    assert len(records) == 1 and records[0].retry_after_s == 30
    # Not honouring: a short pause between refusals, not a tight loop.
    ignores = parse_tenant("ignores:concurrency=1,key=sk-never")
    records = await drive(url, [ignores], duration_s=0.3, model="m")
    assert 1 <= len(records) <= 0.3 / 0.05 + 1

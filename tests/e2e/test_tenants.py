"""Tenants over real sockets, on both client-facing servers: keys name tenants, limits
refuse with 429 and a computed Retry-After, every answer carries the rate-limit headers,
bands reach the engines as `priority`, and operators change limits at runtime."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from narwhal.config.root import parse_config
from narwhal.config.secrets import Secrets, load_secrets
from support.stack import CHAT, COMPLETION, CROSSED, Stack, StackFactory

pytestmark = pytest.mark.both_lanes

KEYS = {"chat": "sk-chat-1111111111", "batch": "sk-batch-2222222222"}
ADMIN_KEY = "sk-admin-3333333333"
TENANTS: list[dict[str, Any]] = [
    {"name": "chat", "api_keys": [KEYS["chat"]], "priority": 0, "weight": 3},
    {
        "name": "batch",
        "api_keys": [KEYS["batch"]],
        "priority": 3,
        "requests_per_minute": 2,
        "tokens_per_minute": 1000,
    },
]
RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


def secrets(tenants: list[dict[str, Any]]) -> Secrets:
    """The keys as `narwhal serve` reads them from the file, and an admin key."""
    engine = {"id": "e", "url": "http://127.0.0.1:1", "role": "both"}
    config = parse_config({"model": "m", "engines": [engine], "tenants": tenants})
    read = load_secrets(config, {})
    return Secrets(read.client_keys, (ADMIN_KEY.encode(),), None, read.tenant_keys)


async def post(
    stack: Stack, key: str | None, body: dict[str, Any] = COMPLETION, route: str = "/v1/completions"
) -> tuple[int, dict[str, str], Any]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with stack.http.post(stack.url + route, json=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


async def test_keys_name_tenants_and_limits_refuse_with_their_headers(
    make_stack: StackFactory,
) -> None:
    async with make_stack(secrets=secrets(TENANTS), tenants=TENANTS) as stack:
        status, _, body = await post(stack, "sk-nobody")
        assert status == 401, body
        status, headers, _ = await post(stack, KEYS["chat"])
        # A tenant without per-minute limits has no rate-limit headers to give.
        assert status == 200 and not set(RATE_HEADERS) & {h.lower() for h in headers}
        answers = [await post(stack, KEYS["batch"]) for _ in range(3)]
        assert [status for status, _, _ in answers] == [200, 200, 429]
        first, _, refused = answers[0][1], answers[1][1], answers[2]
        lower = {name.lower(): value for name, value in first.items()}
        assert lower["x-ratelimit-limit-requests"] == "2"
        assert lower["x-ratelimit-remaining-requests"] == "1"
        assert lower["x-ratelimit-limit-tokens"] == "1000"
        # COMPLETION's 19-byte prompt is 5 tokens by estimate, plus its max_tokens of 8.
        assert lower["x-ratelimit-remaining-tokens"] == "987"
        assert lower["x-ratelimit-reset-requests"].endswith("s")
        status, headers, raw = refused
        lower = {name.lower(): value for name, value in headers.items()}
        # A bucket of 2 a minute holds one request again 30 s after it was emptied.
        assert 25 <= int(lower["retry-after"]) <= 30
        assert lower["x-ratelimit-remaining-requests"] == "0"
        error = orjson.loads(raw)["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "RateLimitError"
        assert "tenant `batch` is over its requests_per_minute (2)" in error["message"]
        # The chat tenant is untouched by the batch tenant's limit.
        assert (await post(stack, KEYS["chat"], CHAT, "/v1/chat/completions"))[0] == 200
        lines = await stack.journal(expect=5, kind="request")
        assert [line.get("tenant") for line in lines] == ["chat", "batch", "batch", "batch", "chat"]
        assert lines[3]["refusal"] == "requests_per_minute" and lines[3]["status"] == 429


async def test_without_tenants_answers_carry_no_rate_limit_headers(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        status, headers, _ = await post(stack, None)
        assert status == 200
        assert not set(RATE_HEADERS) & {name.lower() for name in headers}
        lines = await stack.journal(expect=1, kind="request")
        assert "tenant" not in lines[0] and "refusal" not in lines[0]


async def test_bands_reach_both_legs_as_priority_and_clients_cannot_choose_their_own(
    make_stack: StackFactory,
) -> None:
    async with make_stack(
        CROSSED,
        sim={"scheduling_policy": "priority"},
        secrets=secrets(TENANTS),
        tenants=TENANTS,
        tenants_policy={"engine_priority": True},
    ) as stack:
        body = {**COMPLETION, "priority": -100}
        assert (await post(stack, KEYS["batch"], body))[0] == 200
        prefill, decode = stack.engine("p0").received[-1], stack.engine("d0").received[-1]
        assert (prefill.priority, decode.priority) == (3, 3)
        assert (await post(stack, KEYS["chat"], body))[0] == 200
        assert stack.engine("d0").received[-1].priority == 0


async def test_without_engine_priority_a_tenants_client_priority_is_not_sent(
    make_stack: StackFactory,
) -> None:
    async with make_stack(CROSSED, secrets=secrets(TENANTS), tenants=TENANTS) as stack:
        assert (await post(stack, KEYS["chat"], {**COMPLETION, "priority": -100}))[0] == 200
        assert "priority" not in stack.engine("d0").received[-1].body


async def test_operators_change_a_tenants_limits_at_runtime(make_stack: StackFactory) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with make_stack(secrets=secrets(TENANTS), tenants=TENANTS) as stack:
        url = stack.url + "/narwhal/tenants/batch"
        async with stack.http.patch(url, json={"requests_per_minute": None}, headers=admin) as r:
            assert r.status == 200, await r.text()
            changed = await r.json()
        assert changed["tenant"]["limits"]["requests_per_minute"] is None
        statuses = [(await post(stack, KEYS["batch"]))[0] for _ in range(4)]
        assert statuses == [200] * 4
        async with stack.http.patch(url, json={"max_concurrent": 0}, headers=admin) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["problems"] == ["max_concurrent: must be an integer >= 1, got 0"]
        missing = stack.url + "/narwhal/tenants/nobody"
        async with stack.http.patch(missing, json={"weight": 2}, headers=admin) as r:
            assert r.status == 404
            assert "no tenant is named `nobody`" in (await r.json())["error"]["message"]
        async with stack.http.get(stack.url + "/narwhal/state", headers=admin) as r:
            state = await r.json()
        assert state["tenants"]["batch"]["limits"]["requests_per_minute"] is None


async def test_over_max_concurrent_is_refused_while_its_requests_run(
    make_stack: StackFactory,
) -> None:
    tenants = [{"name": "solo", "api_keys": ["sk-solo-4444444444"], "max_concurrent": 1}]
    async with make_stack(
        sim={"request_overhead_s": 0.4}, secrets=secrets(tenants), tenants=tenants
    ) as stack:
        slow = asyncio.ensure_future(post(stack, "sk-solo-4444444444"))
        # Admitted once its prefill reached the producer; it holds the tenant's one place.
        for _ in range(1000):
            if stack.engine("p0").received:
                break
            await asyncio.sleep(0.01)
        status, headers, raw = await post(stack, "sk-solo-4444444444")
        assert status == 429 and b"max_concurrent (1)" in raw
        assert int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1
        assert (await slow)[0] == 200
        assert (await post(stack, "sk-solo-4444444444"))[0] == 200


async def test_a_streamed_answer_carries_the_rate_limit_headers(make_stack: StackFactory) -> None:
    async with make_stack(secrets=secrets(TENANTS), tenants=TENANTS) as stack:
        status, headers, raw = await post(stack, KEYS["batch"], {**COMPLETION, "stream": True})
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
        lower = {name.lower(): value for name, value in headers.items()}
        assert lower["x-ratelimit-remaining-requests"] == "1"
        assert lower["content-type"] == "text/event-stream"

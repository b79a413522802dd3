"""Operators see tenants: a router with two tenants on simulated engines, one of them held
to its requests-per-minute limit, shows each tenant in its metrics, its journal,
`/narwhal/state`, `narwhal top` and the fleet page."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest_asyncio
from playwright.async_api import Browser, expect
from prometheus_client.parser import text_string_to_metric_families

from e2e.test_fleet_page import LIVE_MS
from narwhal.commands.top import render
from narwhal.config.root import parse_config
from narwhal.config.secrets import load_secrets
from support.stack import COMPLETION, Stack, stack_factory

KEYS = {"search": "sk-search-1111111111", "batch": "sk-batch-2222222222"}
TENANTS = [
    {
        "name": "search",
        "api_keys": [KEYS["search"]],
        "priority": 0,
        "weight": 3,
        "requests_per_minute": 2,
    },
    {"name": "batch", "api_keys": [KEYS["batch"]], "priority": 2},
]


@pytest_asyncio.fixture
async def two_tenants(tmp_path: Path) -> AsyncIterator[Stack]:
    # The tenants' keys are client keys, read from the file as `narwhal serve` reads them.
    engine = {"id": "e", "url": "http://127.0.0.1:1", "role": "both"}
    config = parse_config({"model": "m", "engines": [engine], "tenants": TENANTS}, source="test")
    secrets = load_secrets(config, {})
    async with stack_factory(tmp_path)(secrets=secrets, tenants=TENANTS) as stack:
        yield stack


async def post(stack: Stack, tenant: str) -> int:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with stack.http.post(
        stack.url + "/v1/completions", json=COMPLETION, headers=headers
    ) as response:
        await response.read()
        return response.status


async def serve(stack: Stack) -> None:
    """Search: two served, the third refused by its requests-per-minute limit (its bucket
    of 2 refills one request in 30 s); batch: two served."""
    assert [await post(stack, "search") for _ in range(3)] == [200, 200, 429]
    assert [await post(stack, "batch") for _ in range(2)] == [200, 200]


async def state_of(stack: Stack) -> dict[str, Any]:
    async with stack.http.get(stack.url + "/narwhal/state") as response:
        assert response.status == 200
        state: dict[str, Any] = orjson.loads(await response.read())
        return state


async def test_the_tenant_series_count_each_tenants_requests_and_refusals(
    two_tenants: Stack,
) -> None:
    stack = two_tenants
    await serve(stack)
    await stack.journal(expect=5, kind="request")
    async with stack.http.get(stack.url + "/metrics") as response:
        text = await response.text()
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("narwhal_tenant_"):
                values[sample.name, tuple(sorted(sample.labels.items()))] = sample.value

    def value(name: str, **labels: str) -> float:
        return values[name, tuple(sorted(labels.items()))]

    assert value("narwhal_tenant_requests_total", tenant="search", outcome="ok") == 2
    assert value("narwhal_tenant_requests_total", tenant="search", outcome="client_error") == 1
    assert value("narwhal_tenant_requests_total", tenant="batch", outcome="ok") == 2
    refused = "narwhal_tenant_refusals_total"
    assert value(refused, tenant="search", reason="requests_per_minute") == 1
    assert sum(v for (name, _), v in values.items() if name == refused) == 1
    assert value("narwhal_tenant_tokens_total", tenant="batch", kind="output") > 0
    assert value("narwhal_tenant_tokens_total", tenant="batch", kind="prompt") > 0
    # Only the served requests waited for seats; the refused one never queued.
    assert value("narwhal_tenant_queue_wait_seconds_count", tenant="search") == 2
    assert value("narwhal_tenant_requests_in_flight", tenant="search") == 0
    assert value("narwhal_tenant_requests_queued", tenant="batch") == 0


async def test_the_journal_names_each_requests_tenant(two_tenants: Stack) -> None:
    stack = two_tenants
    await serve(stack)
    lines = await stack.journal(expect=5, kind="request")
    assert sorted((line["tenant"], line["status"]) for line in lines) == [
        ("batch", 200),
        ("batch", 200),
        ("search", 200),
        ("search", 200),
        ("search", 429),
    ]


async def test_state_and_top_show_each_tenant(two_tenants: Stack) -> None:
    stack = two_tenants
    await serve(stack)
    await stack.journal(expect=5, kind="request")
    state = await state_of(stack)
    tenants = state["tenants"]
    assert list(tenants) == ["search", "batch"]
    search = tenants["search"]
    assert (search["priority"], search["weight"]) == (0, 3)
    assert search["limits"]["requests_per_minute"] == 2
    assert search["in_flight"] == 0 and search["queued"] == 0
    # Both requests taken; it refills at 2 a minute, so well under one is back.
    assert 0 <= search["requests_level"] < 1
    assert tenants["batch"]["requests_level"] is None
    assert state["recent"]["tenants"] == {
        "batch": {"requests": 2, "outcomes": {"ok": 2}, "refused": 0},
        "search": {"requests": 3, "outcomes": {"ok": 2, "client_error": 1}, "refused": 1},
    }

    lines = render(state, 140, keys=False)
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("search", "batch"))}
    assert rows["search"][:7] == ["search", "0", "3", "0", "0", "2", "1"]
    assert rows["search"][7:9] == ["rpm", "0/2"]
    assert rows["batch"] == ["batch", "2", "1", "0", "0", "2", "0", "-"]


async def test_the_fleet_page_shows_each_tenant(two_tenants: Stack, browser: Browser) -> None:
    stack = two_tenants
    await serve(stack)
    await stack.journal(expect=5, kind="request")
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(stack.url + "/")
    await expect(page.locator("#tenants")).to_be_visible(timeout=LIVE_MS)
    search = page.locator('[data-tenant="search"]')
    for field, shown in (
        ("band", "0"),
        ("weight", "3"),
        ("in-flight", "0"),
        ("ok", "2"),
        ("refused", "1"),
        ("limits", "rpm 0/2"),
    ):
        await expect(search.locator(f'[data-field="{field}"]')).to_have_text(shown)
    batch = page.locator('[data-tenant="batch"]')
    await expect(batch.locator('[data-field="band"]')).to_have_text("2")
    await expect(batch.locator('[data-field="refused"]')).to_have_text("0")
    # On a phone the table scrolls in its place; the page itself does not.
    await page.set_viewport_size({"width": 390, "height": 844})
    width = "document.documentElement.scrollWidth - window.innerWidth"
    assert await page.evaluate(width) <= 0
    assert errors == []


async def test_a_page_without_tenants_shows_no_tenant_table(
    tmp_path: Path, browser: Browser
) -> None:
    async with stack_factory(tmp_path)() as stack:
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        assert "tenants" not in await state_of(stack)
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        await page.goto(stack.url + "/")
        await expect(page.locator('[data-outcome="ok"]')).to_have_text("ok 1", timeout=LIVE_MS)
        await expect(page.locator("#tenants")).to_be_hidden()

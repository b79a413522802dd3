"""Operators see the model dimension: a router in front of two base models, one with a
LoRA adapter, on simulated engines, shows both models and the adapter in its metrics
labels, its journal, `/narwhal/state`, `narwhal top` and the fleet page."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
from playwright.async_api import Browser, expect
from prometheus_client.parser import text_string_to_metric_families

from e2e.test_fleet_page import LIVE_MS
from narwhal.app.server import RouterServer
from narwhal.commands.top import render
from narwhal.config.root import parse_config
from narwhal.tools.sim.fleet import SimFleet
from support.stack import FAST, Stack, settled

ADAPTERS = (("sql", "/adapters/sql"),)
ENGINES = (
    ("pa", "prefill", "model-a"),
    ("da", "decode", "model-a"),
    ("pb", "prefill", "model-b"),
    ("db", "decode", "model-b"),
)
# (the name a request sends, its pool, its adapter label)
SENT = (("model-a", "model-a", ""), ("sql", "model-a", "sql"), ("model-b", "model-b", ""))


@pytest_asyncio.fixture
async def two_models(tmp_path: Path) -> AsyncIterator[Stack]:
    options = [
        replace(
            FAST,
            name=name,
            model=model,
            # Model A's engines load the adapter when its first request comes.
            runtime_lora_updating=model == "model-a",
            inter_token_s=0.0,
        )
        for name, _, model in ENGINES
    ]
    journal = tmp_path / "journal.jsonl"
    async with SimFleet(options) as fleet:
        config = parse_config(
            {
                "model": "model-a",
                "journal": {"path": str(journal)},
                "models": [{"name": "model-a"}, {"name": "model-b"}],
                "lora": {
                    "load_on_demand": True,
                    "adapters": [
                        {"name": name, "path": path, "base": "model-a"} for name, path in ADAPTERS
                    ],
                },
                "engines": [
                    {"id": name, "url": engine.url, "role": role, "model": model}
                    for (name, role, model), engine in zip(ENGINES, fleet.engines, strict=True)
                ],
            },
            source="test",
        )
        server = RouterServer(config, port=0)
        await server.start()
        try:
            async with aiohttp.ClientSession() as http:
                yield Stack(fleet, server, journal, http)
        finally:
            await server.stop()


async def serve_each(stack: Stack, times: int = 2) -> None:
    for name, _, _ in SENT:
        for i in range(times):
            body = {"model": name, "prompt": f"The sea {i} is deep and", "max_tokens": 4}
            status, answer = await stack.post("/v1/completions", body)
            assert status == 200, answer
    status, _ = await stack.post("/v1/completions", {"model": "model-c", "prompt": "x"})
    assert status == 404
    await settled(stack)


async def state_of(stack: Stack) -> dict[str, Any]:
    async with stack.http.get(stack.url + "/narwhal/state") as response:
        assert response.status == 200
        state: dict[str, Any] = await response.json()
        return state


async def test_the_request_series_carry_each_model_and_adapter(two_models: Stack) -> None:
    stack = two_models
    await serve_each(stack)
    async with stack.http.get(stack.url + "/metrics") as response:
        text = await response.text()
    requests: dict[tuple[str, str], float] = {}
    ttft: dict[tuple[str, str], float] = {}
    engines: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "narwhal_requests_total":
                key = (labels["model"], labels["adapter"])
                requests[key] = requests.get(key, 0) + sample.value
            elif sample.name == "narwhal_ttft_seconds_count":
                ttft[(labels["model"], labels["adapter"])] = sample.value
            elif sample.name == "narwhal_engine_info":
                engines[labels["engine"]] = labels["model"]
    # The unknown name was refused before it had a model: no label value of its own.
    assert requests == {("model-a", ""): 2, ("model-a", "sql"): 2, ("model-b", ""): 2, ("", ""): 1}
    assert {k: v for k, v in ttft.items() if v} == {
        ("model-a", ""): 2,
        ("model-a", "sql"): 2,
        ("model-b", ""): 2,
    }
    assert engines == {name: model for name, _, model in ENGINES}
    assert 'narwhal_engine_seats_in_use{engine="db",model="model-b",phase="decode"}' in text


async def test_the_journal_names_each_requests_model_and_adapter(two_models: Stack) -> None:
    stack = two_models
    await serve_each(stack, times=1)
    lines = await stack.journal(expect=4, kind="request")
    seen = sorted((line["model"] or "", line.get("adapter", "")) for line in lines)
    assert seen == sorted([("", ""), *((pool, adapter) for _, pool, adapter in SENT)])
    assert all("adapter" not in line for line in lines if line["model"] != "model-a")
    # An engine event names its engine's model.
    stack.server.router.fleet.drain(stack.server.router.fleet.by_id["db"], "test")
    (line,) = [
        line
        for line in await stack.journal(expect=len(lines) + 1, kind="engine")
        if line["event"] == "draining"
    ]
    assert line["engine"] == "db" and line["model"] == "model-b"


async def test_state_and_top_show_both_models_and_the_adapter(two_models: Stack) -> None:
    stack = two_models
    await serve_each(stack, times=1)
    state = await state_of(stack)
    engines = {e["id"]: e for e in state["engines"]}
    assert {name: engines[name]["model"] for name, _, _ in ENGINES} == {
        name: model for name, _, model in ENGINES
    }
    # Its first request loaded the adapter on both of its pool's engines.
    assert "sql" in engines["da"]["adapters"] and engines["db"]["adapters"] == []
    pools = state["models"]
    assert list(pools) == ["model-a", "model-b"]
    assert pools["model-a"]["engines"] == {"prefill": ["pa"], "decode": ["da"]}
    assert pools["model-b"]["admitted"] == {"prefill": 1, "decode": 1}
    assert "da" in pools["model-a"]["adapters"]["sql"] and pools["model-b"]["adapters"] == {}

    lines = render(state, 140, keys=False)
    assert lines[0].startswith("narwhal top · models model-a, model-b · serving")
    assert any(line.startswith("model-a: prefill 1/1 · decode 1/1 admitted") for line in lines)
    assert any("adapters sql (" in line for line in lines)
    rows = {line.split()[0]: line.split()[1] for line in lines if line[:3] in ("pa ", "da ")}
    assert rows == {"pa": "model-a", "da": "model-a"}


async def test_the_fleet_page_groups_engines_by_model(two_models: Stack, browser: Browser) -> None:
    stack = two_models
    await serve_each(stack, times=1)
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(stack.url + "/")
    for model in ("model-a", "model-b"):
        group = page.locator(f'[data-model="{model}"]')
        await expect(group.locator("[data-engine]")).to_have_count(2, timeout=LIVE_MS)
        await expect(group.locator('[data-field="pool-summary"]')).to_contain_text(
            "prefill 1/1 · decode 1/1 admitted", timeout=LIVE_MS
        )
    card = page.locator('[data-model="model-a"] [data-engine="da"]')
    await expect(card.locator('[data-field="model"]')).to_have_text("model-a")
    await expect(card.locator('[data-field="adapters"]')).to_contain_text("sql")
    summary = page.locator('[data-model="model-a"] [data-field="pool-summary"]')
    await expect(summary).to_contain_text(re.compile(r"adapters sql \(\d\)"))
    await expect(page.locator("#model")).to_have_text("model-a · model-b")
    assert errors == []


async def test_concurrent_requests_of_both_models_count_apart(two_models: Stack) -> None:
    stack = two_models

    async def one(name: str, i: int) -> int:
        body = {"model": name, "prompt": f"wave {i}", "max_tokens": 3, "stream": i % 2 == 0}
        return (await stack.post("/v1/completions", body))[0]

    statuses = await asyncio.gather(*(one(name, i) for name, _, _ in SENT for i in range(6)))
    assert set(statuses) == {200}
    await settled(stack)
    async with stack.http.get(stack.url + "/metrics") as response:
        text = await response.text()
    counts = {
        (s.labels["model"], s.labels["adapter"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "narwhal_request_duration_seconds_count"
    }
    assert counts == {("model-a", ""): 6, ("model-a", "sql"): 6, ("model-b", ""): 6}

"""One router in front of two base models, one of them with two LoRA adapters, on simulated
engines: every request lands in its pool, no handoff crosses models or adapters, and losing
one model's engines costs the other model nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.fleet import SimFleet
from support.stack import FAST

ADAPTERS = (("sql", "/adapters/sql"), ("poet", "/adapters/poet"))
# Each client-facing name, and the pool and adapter it must reach.
NAMES = {
    "model-a": ("model-a", None),
    "alpha": ("model-a", None),
    "sql": ("model-a", "sql"),
    "poet": ("model-a", "poet"),
    "model-b": ("model-b", None),
    "beta": ("model-b", None),
}
# Which engine serves which pool and phase.
ENGINES = (
    ("pa", "prefill", "model-a"),
    ("da", "decode", "model-a"),
    ("pb", "prefill", "model-b"),
    ("db", "decode", "model-b"),
)
# Time a busy machine may need for the breaker to eject the stopped engines.
EJECTED_WITHIN_S = 30.0


@dataclass
class Mixed:
    fleet: SimFleet
    server: RouterServer
    http: aiohttp.ClientSession

    def engine(self, name: str) -> SimEngine:
        return next(e for e in self.fleet.engines if e.options.name == name)

    async def complete(self, model: str, prompt: str = "The sea is deep and") -> tuple[int, Any]:
        body = {"model": model, "prompt": prompt, "max_tokens": 6}
        async with self.http.post(self.server.url + "/v1/completions", json=body) as response:
            answer = await response.json(content_type=None)
            if response.status != 200:
                answer = {**answer, "retry_after": response.headers.get("Retry-After")}
            return response.status, answer


@pytest_asyncio.fixture
async def mixed(tmp_path: Path) -> AsyncIterator[Mixed]:
    options = [
        replace(
            FAST,
            name=name,
            model=model,
            lora_modules=ADAPTERS if model == "model-a" else (),
            inter_token_s=0.0,
        )
        for name, _, model in ENGINES
    ]
    async with SimFleet(options) as fleet:
        config = parse_config(
            {
                "journal": {"path": str(tmp_path / "journal.jsonl")},
                "recovery": {"eject_after": 1, "readmit_interval_s": 600.0},
                "models": [
                    {"name": "model-a", "aliases": ["alpha"]},
                    {"name": "model-b", "aliases": ["beta"]},
                ],
                "lora": {
                    "adapters": [
                        {"name": name, "path": path, "base": "model-a"} for name, path in ADAPTERS
                    ]
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
                yield Mixed(fleet, server, http)
        finally:
            await server.stop()


async def test_every_request_lands_in_its_pool_and_no_handoff_crosses(mixed: Mixed) -> None:
    rounds = 6
    answers = await asyncio.gather(
        *(mixed.complete(name, f"Prompt {i} for {name}") for name in NAMES for i in range(rounds))
    )
    assert [status for status, _ in answers] == [200] * len(answers), answers
    # The consumer of each pool records every pull: whose blocks, with which weights.
    seen: Counter[tuple[str, str, str | None]] = Counter()
    for name in ("da", "db"):
        engine = mixed.engine(name)
        assert engine.crossed_handoffs() == []
        for handoff in engine.handoffs:
            assert handoff.ok, handoff
            assert handoff.producer_model == handoff.consumer_model == engine.options.model
            seen[(name, handoff.consumer_model, handoff.consumer_adapter)] += 1
    assert seen == {
        ("da", "model-a", None): 2 * rounds,
        ("da", "model-a", "sql"): rounds,
        ("da", "model-a", "poet"): rounds,
        ("db", "model-b", None): 2 * rounds,
    }
    # The engines heard each name as they serve it: an alias is sent as its model.
    for name in ("pb", "db"):
        assert mixed.engine(name).options.model == "model-b"


async def test_models_lists_every_model_adapter_and_alias(mixed: Mixed) -> None:
    async with mixed.http.get(mixed.server.url + "/v1/models") as response:
        assert response.status == 200
        listing = await response.json()
    cards = {card["id"]: card for card in listing["data"]}
    assert set(cards) == set(NAMES)
    for card in cards.values():
        assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"} <= set(
            card
        ), card
        assert card["object"] == "model"
    assert cards["sql"]["parent"] == cards["poet"]["parent"] == "model-a"
    assert cards["model-a"]["parent"] is None and cards["model-b"]["parent"] is None


async def test_an_unknown_model_is_a_404_naming_it(mixed: Mixed) -> None:
    status, answer = await mixed.complete("model-c")
    assert status == 404
    assert answer["error"]["code"] == "model_not_found"
    assert "model-c" in answer["error"]["message"]


async def test_losing_one_models_engines_leaves_the_other_whole(mixed: Mixed) -> None:
    b_answers: list[int] = []
    stop = asyncio.Event()

    async def load_b(worker: int) -> None:
        i = 0
        while not stop.is_set():
            status, _ = await mixed.complete("model-b", f"b {worker} {i}")
            b_answers.append(status)
            i += 1

    workers = [asyncio.create_task(load_b(w)) for w in range(4)]
    try:
        await asyncio.sleep(0.3)
        for name in ("pa", "da"):
            await mixed.engine(name).stop()
        # Model A's requests fail until the breaker has ejected both of its engines.
        loop = asyncio.get_running_loop()
        until = loop.time() + EJECTED_WITHIN_S
        while True:
            status, answer = await mixed.complete("model-a")
            fleet = mixed.server.router.fleet
            ejected = {e.id for e in fleet.engines if e.ejected}
            if status == 503 and ejected == {"pa", "da"}:
                break
            assert loop.time() < until, (status, answer, ejected)
            await asyncio.sleep(0.05)
        assert "model-a" in answer["error"]["message"], answer
        assert answer["retry_after"] is not None
        before = len(b_answers)
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert len(b_answers) > before, "model B kept serving"
    assert b_answers and set(b_answers) == {200}, Counter(b_answers)
    assert {e.id for e in mixed.server.router.fleet.engines if e.ejected} == {"pa", "da"}

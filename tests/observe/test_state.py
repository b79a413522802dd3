"""`/narwhal/state`: each engine's model and adapters, the pools they make, and with
`[[tenants]]` each tenant."""

from __future__ import annotations

import time

import pytest

from narwhal.app.process import Router
from narwhal.config.root import parse_config
from narwhal.fleet.lifecycle import Event
from narwhal.observe.state import snapshot
from support.tenants import admission, tenant_router


def two_models() -> Router:
    return Router(
        parse_config(
            {
                "model": "model-a",
                "models": [{"name": "model-a"}, {"name": "model-b"}],
                "lora": {
                    "adapters": [
                        {"name": "sql", "path": "/adapters/sql", "base": "model-a"},
                        {"name": "poet", "path": "/adapters/poet", "base": "model-a"},
                    ]
                },
                "engines": [
                    {"id": "pa", "url": "http://127.0.0.1:1", "role": "prefill"},
                    {"id": "da", "url": "http://127.0.0.1:2", "role": "decode"},
                    {"id": "xb", "url": "http://127.0.0.1:3", "role": "both", "model": "model-b"},
                    {"id": "db", "url": "http://127.0.0.1:4", "role": "decode", "model": "model-b"},
                ],
            },
            source="test",
        )
    )


async def test_each_engine_shows_its_model_and_adapters() -> None:
    router = two_models()
    router.fleet.by_id["da"].adapters = {"sql": None}
    engines = {e["id"]: e for e in snapshot(router)["engines"]}
    assert engines["pa"]["model"] == engines["da"]["model"] == "model-a"
    assert engines["xb"]["model"] == engines["db"]["model"] == "model-b"
    assert engines["da"]["adapters"] == ["sql"] and engines["pa"]["adapters"] == []


async def test_each_pool_shows_its_engines_by_phase_admitted_and_adapters() -> None:
    router = two_models()
    router.fleet.by_id["da"].adapters = {"sql": None}
    router.fleet.by_id["db"].lifecycle.apply(Event.EJECT, lambda _: None)
    pools = snapshot(router)["models"]
    assert list(pools) == ["model-a", "model-b"]
    assert pools["model-a"] == {
        "engines": {"prefill": ["pa"], "decode": ["da"]},
        "admitted": {"prefill": 1, "decode": 1},
        "can_serve": True,
        "degraded": False,
        # Configured adapters no engine holds yet are listed, with no holder.
        "adapters": {"sql": ["da"], "poet": []},
    }
    # A role `both` engine serves both phases; an ejected engine is listed, not admitted.
    assert pools["model-b"] == {
        "engines": {"prefill": ["xb"], "decode": ["xb", "db"]},
        "admitted": {"prefill": 1, "decode": 1},
        "can_serve": True,
        "degraded": False,
        "adapters": {},
    }
    router.fleet.by_id["xb"].lifecycle.apply(Event.EJECT, lambda _: None)
    pool_b = snapshot(router)["models"]["model-b"]
    assert pool_b["admitted"] == {"prefill": 0, "decode": 0} and pool_b["degraded"]


async def test_a_router_without_tenants_has_no_tenants_section() -> None:
    assert "tenants" not in snapshot(two_models())


async def test_each_tenant_shows_its_settings_load_and_buckets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    router = tenant_router(
        [
            {
                "name": "search",
                "priority": 0,
                "weight": 3,
                "max_concurrent": 4,
                "max_queued": 8,
                "requests_per_minute": 60,
                "tokens_per_minute": 6000,
                "ttft_objective_s": 0.5,
            },
            {"name": "batch", "priority": 2},
        ],
        default="batch",
    )
    limits = admission(router).limits
    for _ in range(2):
        limits.admit("search", 100, time.monotonic())
    limits.admit("batch", 100, time.monotonic())
    monkeypatch.setattr(router.fleet, "queued_by_tenant", lambda: {"search": 1, "": 3})
    tenants = snapshot(router)["tenants"]
    assert list(tenants) == ["search", "batch"]
    search = tenants["search"]
    assert (search["priority"], search["weight"], search["default"]) == (0, 3, False)
    assert search["limits"] == {
        "max_concurrent": 4,
        "max_queued": 8,
        "requests_per_minute": 60,
        "tokens_per_minute": 6000,
        "ttft_objective_s": 0.5,
    }
    assert search["share"] == {
        "max_concurrent": 4,
        "requests_per_minute": 60,
        "tokens_per_minute": 6000,
    }
    assert (search["in_flight"], search["in_flight_here"], search["queued"]) == (2, 2, 1)
    # Two requests taken from full buckets (refilled a little since).
    assert 58 <= search["requests_level"] < 58.5
    assert 5800 <= search["tokens_level"] < 5810
    batch = tenants["batch"]
    assert (batch["priority"], batch["weight"], batch["default"]) == (2, 1, True)
    # Without limits: no store count and no buckets, only this process's requests.
    assert batch["in_flight"] is None and batch["in_flight_here"] == 1
    assert batch["requests_level"] is None and batch["tokens_level"] is None
    assert batch["queued"] == 0

"""`/narwhal/state`: each engine's model and adapters, and the pools they make."""

from __future__ import annotations

from narwhal.app.process import Router
from narwhal.config.root import parse_config
from narwhal.fleet.lifecycle import Event
from narwhal.observe.state import snapshot


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

"""What an engine says about itself: `/v1/models` with adapters, as vLLM 0.32 lists them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from narwhal.tools.sim.describe import models
from narwhal.tools.sim.lora import Adapter
from narwhal.tools.sim.options import SimOptions

if TYPE_CHECKING:
    from tools.sim.conftest import Sim

PERMISSION_KEYS = [
    "id",
    "object",
    "created",
    "allow_create_engine",
    "allow_sampling",
    "allow_logprobs",
    "allow_search_indices",
    "allow_view",
    "allow_fine_tuning",
    "organization",
    "group",
    "is_blocking",
]


def test_the_base_card_comes_first_then_one_per_adapter() -> None:
    options = SimOptions(model="base", max_model_len=2048)
    adapters = [Adapter("sql", "/a/sql", 1), Adapter("poet", "/a/poet", 2)]
    listing = models(options, adapters, now=1700000000.5)
    assert listing["object"] == "list"
    cards = listing["data"]
    assert isinstance(cards, list)
    for card in cards:
        permission = card.pop("permission")
        assert len(permission) == 1 and list(permission[0]) == PERMISSION_KEYS
        assert permission[0]["id"].startswith("modelperm-") and len(permission[0]["id"]) == 26
        assert permission[0]["created"] == 1700000000
    assert cards == [
        {
            "id": "base",
            "object": "model",
            "created": 1700000000,
            "owned_by": "vllm",
            "root": "base",
            "parent": None,
            "max_model_len": 2048,
        },
        {
            "id": "sql",
            "object": "model",
            "created": 1700000000,
            "owned_by": "vllm",
            "root": "/a/sql",
            "parent": "base",
            "max_model_len": None,
        },
        {
            "id": "poet",
            "object": "model",
            "created": 1700000000,
            "owned_by": "vllm",
            "root": "/a/poet",
            "parent": "base",
            "max_model_len": None,
        },
    ]


async def test_v1_models_lists_the_adapters_loaded_now(sim: Sim) -> None:
    engine = await sim.start(
        model="base", lora_modules=(("sql", "/a/sql"),), runtime_lora_updating=True
    )
    listing = orjson.loads((await sim.get(engine, "/v1/models"))[1])
    assert [(m["id"], m["root"], m["parent"]) for m in listing["data"]] == [
        ("base", "base", None),
        ("sql", "/a/sql", "base"),
    ]
    await sim.session.post(engine.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
    listing = orjson.loads((await sim.get(engine, "/v1/models"))[1])
    assert [m["id"] for m in listing["data"]] == ["base"]

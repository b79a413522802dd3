"""Learning what an engine serves from its listing, and the router's own listing."""

from __future__ import annotations

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.models import AdapterSpec, LoraConfig
from narwhal.engines.identity import ModelCard, ServedModels
from narwhal.fleet.models import Catalog, Target
from narwhal.fleet.served import learn, listing
from narwhal.fleet.table import Fleet


def served(base: str, *adapters: str) -> ServedModels:
    cards = {base: ModelCard(base, root=f"/models/{base}", max_model_len=4096, owned_by="vllm")}
    for name in adapters:
        cards[name] = ModelCard(name, root=f"/adapters/{name}", parent=base, owned_by="vllm")
    return ServedModels(base, (), adapters, cards)


def fleet(*models: str | None, catalog: Catalog | None = None) -> Fleet:
    specs = [
        EngineSpec(f"e{i}", f"http://10.0.0.{i}:8000", Role.BOTH, model=model)
        for i, model in enumerate(models)
    ]
    return Fleet(specs, catalog=catalog or Catalog.single("default"))


def test_an_engine_without_a_model_takes_the_base_it_lists() -> None:
    f = fleet(None)
    engine = f.engines[0]
    assert engine.model == "default"
    assert learn(engine, served("m-a", "sql"), dict(engine.adapters))
    f.models_changed()
    assert engine.model == "m-a"
    assert list(engine.adapters) == ["sql"]
    assert f.catalog.resolve("sql") == Target("m-a", "sql")
    assert not learn(engine, served("m-a", "sql"), dict(engine.adapters)), "nothing new"


def test_the_spec_model_wins_over_the_listing() -> None:
    engine = fleet("m-a").engines[0]
    learn(engine, served("m-b"), {})
    assert engine.model == "m-a"


def test_a_load_during_the_read_is_not_undone_by_the_older_listing() -> None:
    engine = fleet("m-a").engines[0]
    engine.adapters = {"old": None, "kept": None}
    before = dict(engine.adapters)
    engine.adapters["loaded-meanwhile"] = None  # the router loaded it while reading
    assert learn(engine, served("m-a", "kept", "fresh"), before)
    # "old" is gone from the engine; the router's own load stays; a new one goes first in
    # the unload order (the router has not used it).
    assert list(engine.adapters) == ["fresh", "kept", "loaded-meanwhile"]


def test_the_listing_has_every_pool_adapter_and_alias_in_vllms_shape() -> None:
    lora = LoraConfig(adapters=(AdapterSpec("poet", "/cfg/poet", "m-a"),))
    catalog = Catalog(
        "m-a",
        {"alpha": Target("m-a"), "m-b": Target("m-b"), "poet": Target("m-a", "poet")},
    )
    f = fleet("m-a", "m-b", catalog=catalog)
    learn(f.engines[0], served("m-a", "sql"), {})
    f.models_changed()
    body = listing(f, lora, created=1700000000)
    assert body["object"] == "list"
    cards = {card["id"]: card for card in body["data"]}
    assert [card["id"] for card in body["data"]] == ["m-a", "poet", "sql", "alpha", "m-b"]
    assert cards["m-a"] == {
        "id": "m-a",
        "object": "model",
        "created": 1700000000,
        "owned_by": "vllm",
        "root": "/models/m-a",
        "parent": None,
        "max_model_len": 4096,
    }
    assert cards["alpha"] == {**cards["m-a"], "id": "alpha"}
    assert cards["sql"]["parent"] == "m-a" and cards["sql"]["root"] == "/adapters/sql"
    # Configured, not yet seen on an engine: its configured path, the router as owner.
    assert cards["poet"]["root"] == "/cfg/poet" and cards["poet"]["owned_by"] == "narwhal"
    assert cards["m-b"]["max_model_len"] is None and cards["m-b"]["root"] == "m-b"

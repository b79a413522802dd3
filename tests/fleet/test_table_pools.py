"""Placement inside one pool: a request goes to the engines of its base model, and for an
adapter to the engines that hold it; no handoff crosses models or adapters."""

from __future__ import annotations

import pytest

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.models import AdapterSpec, LoraConfig
from narwhal.fleet.lifecycle import Event
from narwhal.fleet.models import Catalog, Target
from narwhal.fleet.table import Fleet
from narwhal.protocol.errors import NarwhalError


def spec(engine_id: str, role: Role, model: str) -> EngineSpec:
    return EngineSpec(engine_id, f"http://{engine_id}:8000", role, model=model)


def fleet(lora: LoraConfig | None = None) -> Fleet:
    specs = [
        spec("a-p", Role.PREFILL, "alpha"),
        spec("a-d1", Role.DECODE, "alpha"),
        spec("a-d2", Role.DECODE, "alpha"),
        spec("b-p", Role.PREFILL, "beta"),
        spec("b-d", Role.DECODE, "beta"),
    ]
    names = {"alpha": Target("alpha"), "beta": Target("beta")}
    for adapter in (lora or LoraConfig()).adapters:
        names[adapter.name] = Target(adapter.base, adapter.name)
    return Fleet(specs, catalog=Catalog("alpha", names), lora=lora)


async def test_every_request_lands_in_its_own_pool() -> None:
    table = fleet()
    for _ in range(20):
        for model in ("alpha", "beta"):
            reservation = table.try_reserve(target=Target(model))
            assert reservation is not None
            assert reservation.producer.model == reservation.consumer.model == model
            reservation.release()


async def test_an_ejected_pool_leaves_the_other_untouched() -> None:
    table = fleet()
    for engine in table.pool("alpha"):
        engine.lifecycle.apply(Event.EJECT, table.emit, "test")
        # Refusing connections: not even panic placement may take it.
        engine.refusing = True
    with pytest.raises(NarwhalError) as caught:
        table.try_reserve(target=Target("alpha"))
    assert caught.value.status == 503 and "model `alpha`" in caught.value.message
    reservation = table.try_reserve(target=Target("beta"))
    assert reservation is not None and not reservation.panic
    assert table.can_serve("beta")


async def test_an_adapter_decodes_only_where_it_is_held() -> None:
    table = fleet()
    for engine_id in ("a-p", "a-d2"):
        table.by_id[engine_id].adapters["sql"] = None
    table.models_changed()
    for _ in range(20):
        reservation = table.try_reserve(target=Target("alpha", "sql"))
        assert reservation is not None
        assert (reservation.producer.id, reservation.consumer.id) == ("a-p", "a-d2")
        assert reservation.loads == ()
        reservation.release()
    assert table.by_id["a-d2"].adapter_users == {}


async def test_an_adapter_nobody_holds_is_503_without_load_on_demand() -> None:
    table = fleet()
    with pytest.raises(NarwhalError) as caught:
        table.try_reserve(target=Target("alpha", "sql"))
    assert caught.value.status == 503 and "adapter `sql`" in caught.value.message


async def test_on_demand_an_engine_that_lacks_the_adapter_is_asked_to_load_it() -> None:
    lora = LoraConfig(
        load_on_demand=True,
        max_adapters_per_engine=1,
        adapters=(AdapterSpec("sql", "/loras/sql", "alpha"),),
    )
    table = fleet(lora)
    reservation = table.try_reserve(target=Target("alpha", "sql"))
    assert reservation is not None
    assert {e.id for e in reservation.loads} == {reservation.producer.id, reservation.consumer.id}
    reservation.release()
    # An engine whose one adapter slot is in use may not load another: the only producer
    # is out, and a consumer serves the request whole, after loading it.
    busy = table.by_id["a-p"]
    busy.adapters["chat"] = None
    busy.use_adapter("chat", +1)
    whole = table.try_reserve(target=Target("alpha", "sql"))
    assert whole is not None and whole.fallback and whole.consumer.id != "a-p"
    assert whole.loads == (whole.consumer,)

"""Loading adapters on demand, against simulated engines with runtime LoRA updating."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest_asyncio

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.models import AdapterSpec, LoraConfig
from narwhal.fleet.adapters import Adapters
from narwhal.fleet.models import Catalog, Target
from narwhal.fleet.table import Fleet
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.options import SimOptions

BASE = "base"


@pytest_asyncio.fixture
async def engines(tmp_path: Path) -> AsyncIterator[list[SimEngine]]:
    options = SimOptions(
        model=BASE, runtime_lora_updating=True, check_lora_paths=True, inter_token_s=0.0
    )
    started = [SimEngine(replace(options, name=f"sim-{i}")) for i in range(2)]
    for engine in started:
        await engine.start()
    yield started
    for engine in started:
        await engine.stop()


def setup(
    engines: list[SimEngine], lora: LoraConfig, session: aiohttp.ClientSession
) -> tuple[Fleet, Adapters]:
    specs = [
        EngineSpec("p", engines[0].url, Role.PREFILL, model=BASE),
        EngineSpec("d", engines[1].url, Role.DECODE, model=BASE),
    ]
    names = {a.name: Target(BASE, a.name) for a in lora.adapters}
    fleet = Fleet(specs, catalog=Catalog(BASE, names), lora=lora)
    return fleet, Adapters(fleet, lambda: session, {}, lora)


async def test_the_first_request_loads_the_adapter_on_both_engines(
    engines: list[SimEngine], tmp_path: Path
) -> None:
    (tmp_path / "sql").mkdir()
    lora = LoraConfig(True, None, (AdapterSpec("sql", str(tmp_path / "sql"), BASE),))
    async with aiohttp.ClientSession() as session:
        fleet, adapters = setup(engines, lora, session)
        fleet.prepare = adapters.prepare
        async with await fleet.reserve(target=Target(BASE, "sql")) as reservation:
            assert reservation.loads == ()
        assert [a.name for a in engines[0].loras] == ["sql"]
        assert [a.name for a in engines[1].loras] == ["sql"]
        assert adapters.loads == {"success": 2, "failure": 0}
        # Held now: the next request loads nothing.
        async with await fleet.reserve(target=Target(BASE, "sql")):
            pass
        assert adapters.loads["success"] == 2


async def test_the_bound_unloads_the_least_recently_used(
    engines: list[SimEngine], tmp_path: Path
) -> None:
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    specs = tuple(AdapterSpec(n, str(tmp_path / n), BASE) for n in ("one", "two"))
    lora = LoraConfig(True, 1, specs)
    async with aiohttp.ClientSession() as session:
        fleet, adapters = setup(engines, lora, session)
        fleet.prepare = adapters.prepare
        for name in ("one", "two"):
            async with await fleet.reserve(target=Target(BASE, name)):
                pass
        for engine in engines:
            assert [a.name for a in engine.loras] == ["two"]
        assert all(list(e.adapters) == ["two"] for e in fleet.engines)
        assert adapters.unloads == {"success": 2, "failure": 0}


async def test_a_failed_load_passes_over_that_engine_for_that_adapter_only(
    engines: list[SimEngine], tmp_path: Path
) -> None:
    (tmp_path / "good").mkdir()
    lora = LoraConfig(
        True,
        None,
        (
            AdapterSpec("missing", str(tmp_path / "nowhere"), BASE),
            AdapterSpec("good", str(tmp_path / "good"), BASE),
        ),
    )
    async with aiohttp.ClientSession() as session:
        fleet, adapters = setup(engines, lora, session)
        reservation = fleet.try_reserve(target=Target(BASE, "missing"))
        assert reservation is not None
        assert not await adapters.prepare(reservation)
        reservation.release()
        for engine in fleet.engines:
            assert "missing" in engine.adapter_failed
            assert engine.streak == 0 and not engine.ejected
        good = fleet.try_reserve(target=Target(BASE, "good"))
        assert good is not None and await adapters.prepare(good)
        good.release()

"""What each engine serves, as its `/v1/models` lists it, and the router's own listing.

An engine's base model is its spec's `model` when the file names one, else the base its
listing names (the card whose `parent` is null), else the default model until it is read.
The adapters it lists (cards with a `parent`) are the ones placement may send an adapter's
requests to. Engines are read at start, on each metrics interval and each time readmission
judges one (a restarted engine, one added by hand or by discovery).

`learn` is pure over the engine and the fleet's names; `ServedReader` does the reading.
"""

from __future__ import annotations

import asyncio
from typing import Any

from narwhal.config.models import LoraConfig
from narwhal.engines.http import Fetch
from narwhal.engines.identity import ModelCard, ServedModels, parse_served
from narwhal.fleet.engine import Engine
from narwhal.fleet.table import Fleet

OWNER = "narwhal"


def learn(engine: Engine, served: ServedModels, before: dict[str, None]) -> bool:
    """Take in one listing of `engine`; True when its model or adapters changed.

    `before`: its adapters when the read began. One the router loaded or unloaded while the
    read was under way (`fleet.adapters`) keeps the router's view: a listing older than
    the load must not undo it.
    """
    changed = False
    engine.cards = dict(served.cards)
    if engine.spec.model is None and served.base is not None and served.base != engine.model:
        engine.model = served.base
        changed = True
    listed = dict.fromkeys(served.adapters)
    for gone in [a for a in before if a not in listed and a in engine.adapters]:
        del engine.adapters[gone]
        changed = True
    for name in listed:
        if name not in before and name not in engine.adapters:
            # Not used by the router yet: first in line to be unloaded.
            engine.adapters = {name: None, **engine.adapters}
            changed = True
    return changed


class ServedReader:
    """Reads engines' `/v1/models` and keeps the fleet's pools and names current."""

    def __init__(
        self,
        fleet: Fleet,
        fetch: Fetch,
        timeout_s: float,
        interval_s: float = 0.0,
    ) -> None:
        self.fleet = fleet
        self._fetch = fetch
        self.timeout_s = timeout_s
        self.interval_s = interval_s

    async def read(self, engine: Engine) -> bool:
        """One reading of one engine; False when it could not be read (it keeps what it
        had)."""
        before = dict(engine.adapters)
        body = await self._fetch(engine.url + "/v1/models", self.timeout_s)
        served = None if body is None else parse_served(body)
        if served is None:
            return False
        if learn(engine, served, before):
            self.fleet.models_changed()
        return True

    async def read_all(self) -> None:
        await asyncio.gather(*(self.read(engine) for engine in list(self.fleet.engines)))

    async def run(self) -> None:
        """Every `interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.read_all()


def listing(fleet: Fleet, lora: LoraConfig, created: int) -> dict[str, Any]:
    """`GET /v1/models` for the whole fleet, in vLLM's shape: each pool's base model, its
    adapters, then its aliases (an alias's card is its model's under the alias's id)."""
    names = fleet.catalog.entries()
    bases = list(dict.fromkeys([*fleet.models(), *(t.base for t in names.values())]))
    cards: list[dict[str, Any]] = []
    for base in bases:
        pool = fleet.pool(base)
        base_card = _card(base, pool, created, root=base, parent=None)
        cards.append(base_card)
        adapters = [n for n, t in names.items() if t.base == base and t.adapter == n]
        for engine in pool:
            adapters += [a for a in engine.adapters if a not in adapters]
        for adapter in adapters:
            spec = lora.adapter(adapter)
            root = spec.path if spec is not None else adapter
            cards.append(_card(adapter, pool, created, root=root, parent=base))
        for alias, target in names.items():
            if target.base == base and target.adapter is None and alias != base:
                cards.append({**base_card, "id": alias})
    return {"object": "list", "data": cards}


def _card(
    name: str, pool: list[Engine], created: int, *, root: str, parent: str | None
) -> dict[str, Any]:
    seen: ModelCard | None = next((e.cards[name] for e in pool if name in e.cards), None)
    if seen is not None:
        root = seen.root or root
        parent = seen.parent if seen.parent is not None else parent
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": (seen.owned_by if seen is not None else None) or OWNER,
        "root": root,
        "parent": parent,
        "max_model_len": seen.max_model_len if seen is not None else None,
    }

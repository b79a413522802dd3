"""Which pool a request's `model` names: a base model, an alias of one, or a LoRA adapter.

The fleet is a set of pools, one per base model; an adapter's requests go to the engines
of its base that hold (or may load) it. A name means one thing: the configuration refuses
an alias or adapter that repeats another name, and a name an engine lists later is taken
only where the configuration left it free. The names come from the configuration
(`model`, `[[models]]`, `[[lora.adapters]]`, each engine's `model`) and from what engines
list in `/v1/models` (their base model, and each adapter with its `parent`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from narwhal.config.root import Config
from narwhal.protocol.errors import Cause, NarwhalError

# How many names a 404 lists before it says how many more there are.
_SHOWN = 8


@dataclass(frozen=True, slots=True)
class Target:
    """A request's pool and adapter: the base model whose engines serve it and the adapter
    it runs with (None: the base weights)."""

    base: str
    adapter: str | None = None

    @property
    def served(self) -> str:
        """The name the engines know it by, sent as the legs' `model`."""
        return self.adapter or self.base

    def __str__(self) -> str:
        return self.base if self.adapter is None else f"{self.adapter} (over {self.base})"


class Member(Protocol):
    """What the catalog reads of an engine (`fleet.table.Engine`)."""

    @property
    def model(self) -> str: ...

    @property
    def adapters(self) -> dict[str, None]: ...


def model_not_found(name: str, known: Iterable[str]) -> NarwhalError:
    names = sorted(known)
    listed = ", ".join(f"`{n}`" for n in names[:_SHOWN])
    if len(names) > _SHOWN:
        listed += f" and {len(names) - _SHOWN} more"
    error = NarwhalError(
        404,
        f"The model `{name}` does not exist. This router serves {listed or 'no model yet'}.",
        Cause.BAD_REQUEST,
        param="model",
        code="model_not_found",
    )
    return error


class Catalog:
    """Every name a client may use, kept current as engines report what they serve."""

    def __init__(self, default: str, configured: dict[str, Target] | None = None) -> None:
        """`default`: the model a request without `model` gets; `configured`: the names
        the configuration gives (the default's own always among them)."""
        self.default = default
        self._configured = {default: Target(default), **(configured or {})}
        self._names = dict(self._configured)
        # Several pools, or adapters: placement filters engines by pool.
        self.several = False
        self._refresh_several()

    @classmethod
    def single(cls, model: str) -> Catalog:
        """One pool, of `model`."""
        return cls(model)

    @classmethod
    def from_config(cls, config: Config) -> Catalog:
        """The names `model`, `[[models]]`, each engine's `model` and `[[lora.adapters]]`
        give."""
        names: dict[str, Target] = {}
        for spec in config.engines:
            if spec.model:
                names.setdefault(spec.model, Target(spec.model))
        for model in config.models:
            names.setdefault(model.name, Target(model.name))
        for model in config.models:
            for alias in model.aliases:
                names.setdefault(alias, Target(model.name))
        for adapter in config.lora.adapters:
            names.setdefault(adapter.name, Target(adapter.base, adapter.name))
        return cls(config.model, names)

    def resolve(self, name: str) -> Target:
        """The pool and adapter `name` stands for; 404 (`model_not_found`) naming it when
        nothing serves or is configured by that name."""
        target = self._names.get(name)
        if target is None:
            raise model_not_found(name, self._names)
        return target

    def entries(self) -> dict[str, Target]:
        """Every name a client may use now, and what it stands for."""
        return dict(self._names)

    def learn(self, engines: Iterable[Member]) -> None:
        """Take in what the engines serve now (their models and adapters): names the
        configuration does not hold come and go with the engines that list them."""
        names = dict(self._configured)
        for engine in engines:
            names.setdefault(engine.model, Target(engine.model))
            for adapter in engine.adapters:
                names.setdefault(adapter, Target(engine.model, adapter))
        self._names = names
        self._refresh_several()

    def _refresh_several(self) -> None:
        bases = {target.base for target in self._names.values()}
        adapters = any(target.adapter for target in self._names.values())
        self.several = len(bases) > 1 or adapters

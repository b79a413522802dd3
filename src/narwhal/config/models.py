"""`[[models]]` and `[lora]`: the base models a fleet serves, the names clients may use for
them, their own timeouts and objectives, and the LoRA adapters the router may load.

A client names a base model, an alias or an adapter in `model`, as with vLLM. The top-level
`model` stays for one-model fleets; once engines or `[[models]]` name their models it is
optional, and it is the model a request without `model` gets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from narwhal.config.controller import SloConfig
from narwhal.config.table import Problems, Table, show

RELEASE_MODEL: Final = "narwhal-release-abandoned-handoff"
"""A model name no engine serves, so that a consumer turns a release request away before
any work (`engines.release`); no model, alias or adapter may take it."""

# The `[engine]` keys one model may set for itself: those that bound one request's legs.
MODEL_ENGINE_KEYS: Final = (
    "first_token_timeout_s",
    "decode_read_timeout_s",
    "prefill_timeout_s",
    "whole_answer_timeout_s",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One `[[models]]` entry. `engine` and `slo` hold only the keys it overrides; `None`
    everywhere else takes the router-wide value."""

    name: str
    aliases: tuple[str, ...] = ()
    engine: Mapping[str, float] = field(default_factory=dict)
    slo: SloConfig | None = None


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One `[[lora.adapters]]` entry: what the router loads on an engine of `base`."""

    name: str
    path: str
    base: str


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """`[lora]`: loading adapters on demand, and how many an engine keeps."""

    load_on_demand: bool = False
    # None: no bound of the router's own (the engine's `--max-loras` still holds).
    max_adapters_per_engine: int | None = None
    adapters: tuple[AdapterSpec, ...] = ()
    # Seconds one load (or unload) may take before it counts as failed.
    load_timeout_s: float = 60.0
    # How long an engine whose load of an adapter failed is passed over for that adapter.
    load_failure_quarantine_s: float = 30.0

    def adapter(self, name: str) -> AdapterSpec | None:
        for adapter in self.adapters:
            if adapter.name == name:
                return adapter
        return None


def model_name(table: Table, key: str, *, required: bool) -> str | None:
    """A model name (any non-empty string, as vLLM's served names), or None when absent."""
    if not required and not table.has(key):
        table.take(key, required=False)
        return None
    return table.string(key, None)


def parse_model(table: Table, slo: SloConfig) -> ModelConfig:
    """One `[[models]]` entry; `slo`: the router-wide `[slo]` an override starts from."""
    name = model_name(table, "name", required=True) or ""
    aliases = table.strings("aliases")
    engine: dict[str, float] = {}
    overrides = table.optional_table("engine")
    if overrides is not None:
        for key in MODEL_ENGINE_KEYS:
            if overrides.has(key):
                zero_ok = key in ("decode_read_timeout_s", "whole_answer_timeout_s")
                engine[key] = overrides.number(key, 1.0, zero_ok=zero_ok)
        for key in overrides.rest():
            overrides.fail(
                key,
                "is not a per-model key (a model may set "
                + ", ".join(MODEL_ENGINE_KEYS)
                + "; set the rest in [engine])",
            )
    slo_table = table.optional_table("slo")
    model_slo = None
    if slo_table is not None:
        model_slo = SloConfig(
            ttft_s=slo_table.number("ttft_s", slo.ttft_s),
            tpot_s=slo_table.number("tpot_s", slo.tpot_s),
        )
        slo_table.close()
    table.close()
    return ModelConfig(name, aliases, engine, model_slo)


def parse_lora(table: Table) -> LoraConfig:
    d = LoraConfig()
    adapters: list[AdapterSpec] = []
    for index, entry in enumerate(table.items("adapters", required=False) or ()):
        item = Table(table.problems, table.path(f"adapters[{index}]"), entry)
        name = model_name(item, "name", required=True) or ""
        path = item.string("path", None)
        base = model_name(item, "base", required=True) or ""
        item.close()
        adapters.append(AdapterSpec(name, path, base))
    bound = table.optional_integer("max_adapters_per_engine", 1)
    lora = LoraConfig(
        load_on_demand=table.boolean("load_on_demand", d.load_on_demand),
        max_adapters_per_engine=bound,
        adapters=tuple(adapters),
        load_timeout_s=table.number("load_timeout_s", d.load_timeout_s),
        load_failure_quarantine_s=table.number(
            "load_failure_quarantine_s", d.load_failure_quarantine_s, zero_ok=True
        ),
    )
    seen: set[str] = set()
    for index, adapter in enumerate(adapters):
        if adapter.name and adapter.name in seen:
            table.fail(f"adapters[{index}].name", f"duplicate adapter {show(adapter.name)}")
        seen.add(adapter.name)
    if lora.load_on_demand and not adapters:
        table.fail(
            "load_on_demand",
            "needs [[lora.adapters]] entries: the router loads only adapters it knows the path of",
        )
    table.close()
    return lora


def check_names(
    default: str | None,
    models: tuple[ModelConfig, ...],
    lora: LoraConfig,
    engine_models: Mapping[str, str],
    problems: Problems,
) -> None:
    """Every client-facing name means one thing: a base model, an alias or an adapter.

    `engine_models`: each engine entry's key path to the model it names.
    """
    fail = problems.add
    bases = {name for name in (default, *engine_models.values()) if name}
    bases |= {model.name for model in models}
    owner: dict[str, str] = {}
    for index, model in enumerate(models):
        path = f"models[{index}]"
        if model.name in owner:
            fail(f"{path}.name", f"duplicate model {show(model.name)}")
        owner.setdefault(model.name, f"{path}.name")
        for position, alias in enumerate(model.aliases):
            where = f"{path}.aliases[{position}]"
            if alias in bases or alias in owner:
                fail(where, f"{show(alias)} is already the name of a model or an alias")
            owner.setdefault(alias, where)
    for index, adapter in enumerate(lora.adapters):
        where = f"lora.adapters[{index}].name"
        if adapter.name in bases or adapter.name in owner:
            fail(where, f"{show(adapter.name)} is already the name of a model or an alias")
        owner.setdefault(adapter.name, where)
        if adapter.base and adapter.base not in bases:
            fail(
                f"lora.adapters[{index}].base",
                f"names no model of this fleet ({show(adapter.base)}; models: "
                + (", ".join(sorted(bases)) or "none named")
                + ")",
            )
    for name in sorted(bases | set(owner)):
        if name == RELEASE_MODEL:
            fail(owner.get(name, "model"), f"{show(name)} is reserved by the router")

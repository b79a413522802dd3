"""What a reloaded config file changes in the running fleet: a pure difference, no I/O.

The file is the truth for which engines exist and how each is specified; an engine's
runtime standing (ejected, drained, pinned) is the router's and stays. Compared by id:

| the file...                                  | the plan                                  |
|----------------------------------------------|-------------------------------------------|
| names an id the fleet lacks                  | add it                                    |
| lacks an id the fleet has                    | drain it, delete it once idle             |
| gives an id another role, seat limits,       | change it in place (running requests keep |
|   identity_url or kv_hosts                   |   their seats)                            |
| gives an id another url                      | refused: that is another engine; give it  |
|                                              |   a new id                                |
| changes anything outside `[[engines]]`       | not applied: listed as needing a restart  |

A plan with problems is not applied at all, so a reload is all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from narwhal.config.engine_spec import EngineSpec
from narwhal.config.root import Config

# EngineSpec fields an engine may change in place, in the order they are reported.
IN_PLACE = ("role", "max_prefill_seats", "max_decode_seats", "identity_url", "kv_hosts")
# Config fields a reload never applies (`engines` is the plan itself; `derived` follows).
_NOT_SECTIONS = frozenset({"engines", "derived"})


@dataclass(frozen=True, slots=True)
class Change:
    """An engine kept under its id with a new spec; `keys` names what differs."""

    spec: EngineSpec
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    add: tuple[EngineSpec, ...] = ()
    change: tuple[Change, ...] = ()
    remove: tuple[str, ...] = ()
    # Differences a running router cannot apply: the plan must not be applied.
    problems: tuple[str, ...] = ()
    # Top-level keys or tables that differ but take effect only at the next start.
    restart_required: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        """Whether the engine list is already as the file says."""
        return not (self.add or self.change or self.remove)


def diff_engines(live: Sequence[EngineSpec], target: Sequence[EngineSpec]) -> Plan:
    """The engine list changes that turn `live` into `target`, in `target`'s order."""
    current = {spec.id: spec for spec in live}
    wanted = {spec.id for spec in target}
    add: list[EngineSpec] = []
    change: list[Change] = []
    problems: list[str] = []
    for spec in target:
        before = current.get(spec.id)
        if before is None:
            add.append(spec)
        elif before.url != spec.url:
            problems.append(
                f"engines: {spec.id}: url changed from {before.url} to {spec.url}; an engine "
                "keeps its url for life: give the new engine a new id"
            )
        else:
            keys = tuple(key for key in IN_PLACE if getattr(before, key) != getattr(spec, key))
            if keys:
                change.append(Change(spec, keys))
    remove = tuple(spec.id for spec in live if spec.id not in wanted)
    return Plan(tuple(add), tuple(change), remove, tuple(problems))


def restart_only(running: Config, loaded: Config) -> tuple[str, ...]:
    """The keys and tables besides `[[engines]]` whose values differ between two configs,
    less tenants' bands, weights, limits and policy, which a reload applies
    (`tenants_live`)."""
    return tuple(
        f.name
        for f in fields(Config)
        if f.name not in _NOT_SECTIONS
        and getattr(running, f.name) != getattr(loaded, f.name)
        and not (f.name == "tenants" and tenants_live(running, loaded))
        and not (f.name == "tenants_policy" and policy_live(running, loaded))
    )


def policy_live(running: Config, loaded: Config) -> bool:
    """Whether a reload can apply `[tenants_policy]`: all but `reserved_seats`, which the
    fleet counts from its start."""
    return (
        tenants_live(running, loaded)
        and running.tenants_policy.reserved_seats == loaded.tenants_policy.reserved_seats
    )


def tenants_live(running: Config, loaded: Config) -> bool:
    """Whether a reload can apply the file's tenants as they are: the router had tenants
    and keeps some, and every tenant keeps its keys (keys are read once, at start)."""
    if not running.tenants or not loaded.tenants:
        return False
    none: tuple[tuple[str, ...], str | None] = ((), None)
    before = {t.name: (t.api_keys, t.api_keys_env) for t in running.tenants}
    after = {t.name: (t.api_keys, t.api_keys_env) for t in loaded.tenants}
    return all(before.get(name, none) == after.get(name, none) for name in {*before, *after})


def plan(live: Sequence[EngineSpec], running: Config, loaded: Config) -> Plan:
    """The whole reload: the engine changes, and what else differs but waits for a restart."""
    engines = diff_engines(live, loaded.engines)
    return Plan(
        engines.add,
        engines.change,
        engines.remove,
        engines.problems,
        restart_only(running, loaded),
    )

"""Operators' changes to a live fleet: add, drain, readmit, change and delete engines, and
reload the config file. Each change is checked here, applied to the `Fleet`, and journaled
as an engine event (an engine's adding, drain, readmit and deletion by its `lifecycle`); the
HTTP surface is `admin`, the reload's difference `reconfigure`.

An engine's life under an operator:

| action  | allowed when                        | effect                                       |
|---------|-------------------------------------|----------------------------------------------|
| add     | its id and url are not in the fleet | judged by readmission at once (health,       |
|         |                                     |   contract, a transfer), then admitted       |
| drain   | not already drained; phase floors   | no new work; `draining` until its requests   |
|         |   hold (or `force`)                 |   end, then `drained`                        |
| readmit | draining or drained                 | back in placement (readmission still judges  |
|         |                                     |   it if the breaker had ejected it)          |
| change  | role change keeps phase floors      | new role, seat limits or pin; running        |
|         |   (or `force`)                      |   requests keep their seats                  |
| delete  | drained (idle)                      | forgotten: state, metrics, page              |
| move    | role `both`, not pinned, floors     | the role controller's change of the phase it |
|         |   hold                              |   acts in; running requests finish there     |

**Phase floors.** A drain, or a role change, is refused (409) when it would leave a phase
the engine serves with no *other* engine in service for it (admitted, or quarantined for a
few seconds), unless forced. This holds for prefill too, although aggregate fallback would
let decode engines serve whole requests: fallback is the degraded mode for failures (it
turns `/health` to `degraded` and costs every request its prompt computed on the decode
engine), as the breaker spares the last engine of either phase, so an operator takes the
fleet there only on purpose, with `force`.

**Reload** re-reads the file the router started from and applies `reconfigure.plan`:
engines added, changed in place, and dropped ones drained (floors do not apply: a valid
file has engines for both phases) and deleted once idle. A file that does not validate,
or a plan with problems, changes nothing and the reasons are returned and logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.engines import (
    parse_engine_entry,
    parse_engine_patch,
    problem_path,
    same_engine_url,
)
from narwhal.config.root import Config, ConfigError, load_config
from narwhal.fleet.reconfigure import IN_PLACE, Plan, plan
from narwhal.fleet.table import Engine, EngineEvent, EngineState, Fleet, Phase

log = logging.getLogger("narwhal.operations")

IN_SERVICE = frozenset({EngineState.ADMITTED, EngineState.QUARANTINED})


class OperationError(Exception):
    """A refused change: an HTTP status, a message, the body key at fault, and every
    problem found (a body or config file may have several)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        problems: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.problems = problems


def floor_breach(
    fleet: Fleet, engine: Engine, phases: tuple[Phase, ...], now: float
) -> Phase | None:
    """The first of `phases` that `engine` serves and no other engine in service serves."""
    for phase in phases:
        if not engine.serves(phase):
            continue
        if not any(
            other is not engine and other.serves(phase) and other.state(now) in IN_SERVICE
            for other in fleet.engines
        ):
            return phase
    return None


def _unknown(engine_id: str) -> OperationError:
    return OperationError(404, f"no engine {engine_id!r} in the fleet")


def _bad_body(error: ConfigError) -> OperationError:
    return OperationError(
        400,
        "; ".join(error.problems),
        param=problem_path(error),
        problems=error.problems,
    )


def _describe(spec: EngineSpec) -> str:
    return (
        f"{spec.role.value} at {spec.url}, seats prefill {spec.max_prefill_seats} "
        f"decode {spec.max_decode_seats}"
    )


class FleetOperations:
    """The admin actions over one fleet; `config_path` is the file `reload` re-reads."""

    def __init__(self, fleet: Fleet, config: Config, config_path: Path | None = None) -> None:
        self.fleet = fleet
        self.config = config
        self.config_path = config_path
        # Why each engine on its way out goes (for its `removed` event).
        self._removal_why: dict[str, str] = {}
        # Told each reloaded file once it applied (tenants' limits follow it).
        self.reloaded: list[Callable[[Config], None]] = []
        fleet.listeners.append(self._on_event)

    def engine(self, engine_id: str) -> Engine:
        engine = self.fleet.by_id.get(engine_id)
        if engine is None:
            raise _unknown(engine_id)
        return engine

    # The actions -------------------------------------------------------------------

    def add(self, body: object) -> Engine:
        """POST /narwhal/engines: one `[[engines]]` entry."""
        try:
            spec = parse_engine_entry(body, self.config.server)
        except ConfigError as error:
            raise _bad_body(error) from None
        self._refuse_clash(spec)
        return self._add(spec, "by an operator")

    def drain(self, engine_id: str, *, force: bool = False) -> Engine:
        """POST /narwhal/engines/{id}/drain; refused at a phase floor unless forced."""
        engine = self.engine(engine_id)
        if engine.draining:
            raise OperationError(409, f"engine {engine_id} is already {engine.state(_now()).value}")
        breach = floor_breach(self.fleet, engine, tuple(Phase), _now())
        if breach is not None and not force:
            raise OperationError(
                409,
                f"draining engine {engine_id} would leave no admitted engine to {breach.value}"
                f" (no other {breach.value} engine is admitted); add or readmit one first, "
                "or drain with ?force=true",
            )
        forced = f"; forced: no other admitted {breach.value} engine" if breach else ""
        self._drain(engine, "by an operator" + forced)
        return engine

    def readmit(self, engine_id: str) -> Engine:
        """POST /narwhal/engines/{id}/readmit: ends a drain."""
        engine = self.engine(engine_id)
        if not engine.draining:
            raise OperationError(
                409,
                f"engine {engine_id} is {engine.state(_now()).value}, not drained: readmit ends "
                "a drain (an ejected engine returns through readmission probes)",
            )
        self._undrain(engine, "drain ended by an operator")
        return engine

    def patch(self, engine_id: str, body: object, *, force: bool = False) -> Engine:
        """PATCH /narwhal/engines/{id}: role, seat limits, pin."""
        engine = self.engine(engine_id)
        try:
            patch = parse_engine_patch(body)
        except ConfigError as error:
            raise _bad_body(error) from None
        spec = patch.apply(engine.spec)
        dropped = tuple(p for p in Phase if engine.serves(p) and not _serves(spec, p))
        breach = floor_breach(self.fleet, engine, dropped, _now()) if not engine.draining else None
        if breach is not None and not force:
            raise OperationError(
                409,
                f"engine {engine_id} as {spec.role.value} would leave no admitted engine to "
                f"{breach.value} (no other {breach.value} engine is admitted); use ?force=true "
                "to change it anyway",
            )
        pin_changed = patch.pin is not None and patch.pin != engine.pinned
        if pin_changed:
            engine.pinned = bool(patch.pin)
        self._change(engine, spec, extra=(f"pinned {engine.pinned}",) if pin_changed else ())
        return engine

    def move(
        self,
        engine_id: str,
        to: Role,
        why: str,
        *,
        reason: str | None = None,
        inputs: Mapping[str, object] | None = None,
        now: float | None = None,
    ) -> Engine:
        """The role controller's change: a role `both` engine now acts in `to` alone.

        Placement sees the new role at once, so the engine takes no new work of its old
        phase, while requests holding its seats finish there. Refused (409) for a pinned
        engine, one whose spec role is not `both`, or a move that would leave a phase with
        no other engine in service.
        """
        engine = self.engine(engine_id)
        now = _now() if now is None else now
        if engine.pinned:
            raise OperationError(409, f"engine {engine_id} is pinned: its role stays")
        if engine.spec.role is not Role.BOTH or to is Role.BOTH:
            raise OperationError(
                409,
                f"engine {engine_id} has role {engine.spec.role.value}: only a role both "
                "engine moves, to prefill or decode",
            )
        before = engine.role
        if before is to:
            return engine
        dropped = tuple(p for p in Phase if engine.serves(p) and not to.can_do(p))
        breach = floor_breach(self.fleet, engine, dropped, now)
        if breach is not None:
            raise OperationError(
                409, f"moving engine {engine_id} would leave no admitted engine to {breach.value}"
            )
        engine.acting, engine.role_since = to, now
        self.fleet.emit(
            EngineEvent(
                "role_change",
                engine_id,
                f"{before.value} -> {to.value}; {why}",
                reason=reason,
                inputs=inputs,
            )
        )
        self.fleet.seat_freed()  # a new phase may serve waiters
        return engine

    def delete(self, engine_id: str) -> None:
        """DELETE /narwhal/engines/{id}: only a drained, idle engine."""
        engine = self.engine(engine_id)
        state = engine.state(_now())
        if state is EngineState.DRAINING:
            raise OperationError(
                409,
                f"engine {engine_id} is still draining ({engine.prefill_seats} prefill and "
                f"{engine.decode_seats} decode seats in use): delete it once it is drained",
            )
        if state is not EngineState.DRAINED:
            raise OperationError(
                409,
                f"engine {engine_id} is {state.value}: drain it first "
                f"(POST /narwhal/engines/{engine_id}/drain), then delete it once drained",
            )
        self._remove(engine, "by an operator")

    def reload(self) -> dict[str, Any]:
        """Re-read the config file and apply its engine list; all or nothing."""
        if self.config_path is None:
            raise OperationError(409, "this router was not started from a config file")
        try:
            loaded = load_config(self.config_path)
        except ConfigError as error:
            raise OperationError(
                400,
                f"{error.source}: not reloaded, the running fleet is kept: "
                + "; ".join(error.problems),
                problems=error.problems,
            ) from None
        # Discovered engines are discovery's to add and remove, not the file's.
        filed = [e.spec for e in self.fleet.engines if e.source is None]
        changes = plan(filed, self.config, loaded)
        if changes.problems:
            raise OperationError(
                400,
                f"{self.config_path}: not reloaded, the running fleet is kept: "
                + "; ".join(changes.problems),
                problems=changes.problems,
            )
        self._apply(changes)
        for hook in self.reloaded:
            hook(loaded)
        return {
            "path": str(self.config_path),
            "added": [spec.id for spec in changes.add],
            "changed": {c.spec.id: list(c.keys) for c in changes.change},
            "removing": list(changes.remove),
            "restart_required": list(changes.restart_required),
        }

    def reload_and_log(self) -> None:
        """SIGHUP: reload, with the outcome in the log either way."""
        try:
            result = self.reload()
        except OperationError as error:
            log.error("reload refused: %s", error.message)
            return
        log.info(
            "reloaded %s: added %s, changed %s, removing %s%s",
            result["path"],
            result["added"] or "none",
            result["changed"] or "none",
            result["removing"] or "none",
            f"; needs a restart to apply: {', '.join(result['restart_required'])}"
            if result["restart_required"]
            else "",
        )

    # Applying ----------------------------------------------------------------------

    def _apply(self, changes: Plan) -> None:
        why = f"reload of {self.config_path}"
        for engine in list(self.fleet.engines):
            # Back in the file while a reload's drain was still under way: it stays.
            filed = engine.source is None
            if filed and engine.remove_when_drained and engine.id not in changes.remove:
                self._undrain(engine, f"{why}: back in the config file")
        for change in changes.change:
            self._change(self.fleet.by_id[change.spec.id], change.spec, why=why)
        for spec in changes.add:
            self._add(spec, why)
        for engine_id in changes.remove:
            self.retire(self.fleet.by_id[engine_id], f"{why}: not in the file")

    # For engine sources (discovery): the same changes, each with its reason ----------

    def add_from(self, source: str, spec: EngineSpec, why: str) -> Engine:
        """A new engine found by `source`; readmission judges it before it takes work."""
        return self.fleet.add(spec, f"{_describe(spec)}; {why}", source=source)

    def drain_for(self, engine: Engine, why: str) -> None:
        """No new work; no phase floor: the source says the engine cannot take it."""
        self._drain(engine, why)

    def undrain_for(self, engine: Engine, why: str) -> None:
        self._undrain(engine, why)

    def change_for(self, engine: Engine, spec: EngineSpec, why: str) -> None:
        self._change(engine, spec, why=why)

    def retire(self, engine: Engine, why: str) -> None:
        """Drain the engine and delete it once its last request has finished."""
        engine.remove_when_drained = True
        self._removal_why[engine.id] = why
        if not engine.draining:
            self._drain(engine, f"{why}; deleted once drained")
        elif not engine.busy():
            self._remove(engine, why)
        # Else draining with requests still there: its `drained` event removes it.

    def _refuse_clash(self, spec: EngineSpec) -> None:
        if spec.id in self.fleet.by_id:
            raise OperationError(409, f"engine {spec.id!r} is already in the fleet", param="id")
        for other in self.fleet.engines:
            if same_engine_url(other.url, spec.url):
                raise OperationError(
                    409, f"engine {other.id} already has url {spec.url}", param="url"
                )

    def _add(self, spec: EngineSpec, why: str) -> Engine:
        return self.fleet.add(spec, f"{_describe(spec)}; {why}")

    def _drain(self, engine: Engine, why: str) -> None:
        self.fleet.drain(engine, why)

    def _undrain(self, engine: Engine, why: str) -> None:
        # An undrain leaves an ejection standing (the lifecycle's drain overlays it).
        still = "; still ejected: readmission judges it" if engine.ejected else ""
        self.fleet.undrain(engine, why + still)

    def _change(
        self,
        engine: Engine,
        spec: EngineSpec,
        *,
        why: str = "by an operator",
        extra: tuple[str, ...] = (),
    ) -> None:
        before = engine.spec
        keys = [
            f"{key} {getattr(before, key)} -> {getattr(spec, key)}"
            for key in IN_PLACE
            if getattr(before, key) != getattr(spec, key)
        ] + list(extra)
        if not keys:
            return
        if before.role != spec.role:
            engine.acting = spec.start_as
        engine.spec = spec
        self.fleet.emit(EngineEvent("changed", engine.id, f"{', '.join(keys)}; {why}"))
        self.fleet.seat_freed()  # more seats, or a new phase, may serve waiters

    def _remove(self, engine: Engine, why: str) -> None:
        self._removal_why.pop(engine.id, None)
        self.fleet.remove(engine, why)

    def _on_event(self, event: EngineEvent) -> None:
        """An engine a reload or a source dropped goes once its last request has finished."""
        if event.kind != "drained":
            return
        engine = self.fleet.by_id.get(event.engine)
        if engine is not None and engine.remove_when_drained:
            self._remove(engine, self._removal_why.pop(engine.id, "dropped"))


def _serves(spec: EngineSpec, phase: Phase) -> bool:
    return spec.role.can_prefill if phase is Phase.PREFILL else spec.role.can_decode


def _now() -> float:
    return asyncio.get_running_loop().time()

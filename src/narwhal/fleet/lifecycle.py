"""An engine's lifecycle: its stages, the events that move it, and the one table of moves.

Every change of an engine's standing is an `Event` given to its `Lifecycle.apply`, which
looks the move up in `TRANSITIONS`, makes it, and tells the fleet's listeners (the
journal, metrics, logs, readmission) in the event's own words. A pair not in the table
is a bug in the caller: `apply` raises `LifecycleError` and changes nothing.

| stage            | means                                                           |
|------------------|-----------------------------------------------------------------|
| new              | added at runtime, not yet in the fleet's list                   |
| admitted         | placement may use it                                            |
| quarantined      | admitted, but out of placement until a time: it decays back to  |
|                  |   admitted by itself, with no event                             |
| ejected          | the breaker took it out (or it was added at runtime); only      |
|                  |   readmission brings it back                                    |
| held             | ejected, passed readmission, waits for the rest of its restart  |
|                  |   wave                                                          |
| draining         | an operator's drain over an admitted (or quarantined) engine    |
| draining_ejected | an operator's drain over an ejected (or held) engine            |
| removed          | forgotten by the fleet; no event moves it again                 |

A drain overlays ejection: the breaker never ejects a draining engine and readmission
never judges one, and the operator's undrain returns it to where it was underneath
(ejected, or admitted; a quarantine's time runs on underneath). A drained engine leaves
any restart wave, so a held one is ejected again underneath. `EngineState` is what an
operator sees (`/narwhal/state`, the fleet page): a draining engine shows `draining`
while a request holds one of its seats, `drained` once idle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from types import MappingProxyType

from narwhal.fleet.events import EngineEvent


class EngineState(StrEnum):
    ADMITTED = "admitted"
    QUARANTINED = "quarantined"
    EJECTED = "ejected"
    # Passed readmission; waits for the rest of its restart wave.
    HELD = "held"
    # Drained by an operator: no new work; requests already there still hold seats.
    DRAINING = "draining"
    # Drained by an operator and idle: may be deleted.
    DRAINED = "drained"


class Stage(StrEnum):
    NEW = "new"
    ADMITTED = "admitted"
    QUARANTINED = "quarantined"
    EJECTED = "ejected"
    HELD = "held"
    DRAINING = "draining"
    DRAINING_EJECTED = "draining_ejected"
    REMOVED = "removed"


class Event(StrEnum):
    # A runtime add puts the engine in the fleet, out of placement until its first probe.
    JOIN = "join"
    # A failure keeps the engine out of placement for a few seconds.
    QUARANTINE = "quarantine"
    # The breaker would eject it but for `recovery.max_ejected_fraction`.
    SPARE = "spare"
    EJECT = "eject"
    # Passed readmission inside an open restart wave.
    PASS = "pass"
    READMIT = "readmit"
    DRAIN = "drain"
    # A draining engine's last request finished.
    SETTLE = "settle"
    # An operator's (or a source's) readmit: the drain ends.
    UNDRAIN = "undrain"
    REMOVE = "remove"


_S, _E = Stage, Event

# (the stage the engine is in, the event) -> the stage it moves to.
TRANSITIONS: Mapping[tuple[Stage, Event], Stage] = MappingProxyType(
    {
        (_S.NEW, _E.JOIN): _S.EJECTED,
        # A quarantine: a longer one extends it (the later end wins), a shorter one does not.
        (_S.ADMITTED, _E.QUARANTINE): _S.QUARANTINED,
        (_S.QUARANTINED, _E.QUARANTINE): _S.QUARANTINED,
        (_S.DRAINING, _E.QUARANTINE): _S.DRAINING,
        (_S.ADMITTED, _E.SPARE): _S.ADMITTED,
        (_S.QUARANTINED, _E.SPARE): _S.QUARANTINED,
        (_S.ADMITTED, _E.EJECT): _S.EJECTED,
        (_S.QUARANTINED, _E.EJECT): _S.EJECTED,
        (_S.EJECTED, _E.PASS): _S.HELD,
        (_S.EJECTED, _E.READMIT): _S.ADMITTED,
        (_S.HELD, _E.READMIT): _S.ADMITTED,
        (_S.ADMITTED, _E.DRAIN): _S.DRAINING,
        (_S.QUARANTINED, _E.DRAIN): _S.DRAINING,
        (_S.EJECTED, _E.DRAIN): _S.DRAINING_EJECTED,
        (_S.HELD, _E.DRAIN): _S.DRAINING_EJECTED,
        (_S.DRAINING, _E.SETTLE): _S.DRAINING,
        (_S.DRAINING_EJECTED, _E.SETTLE): _S.DRAINING_EJECTED,
        (_S.DRAINING, _E.UNDRAIN): _S.ADMITTED,
        (_S.DRAINING_EJECTED, _E.UNDRAIN): _S.EJECTED,
        (_S.DRAINING, _E.REMOVE): _S.REMOVED,
        (_S.DRAINING_EJECTED, _E.REMOVE): _S.REMOVED,
    }
)

# The engine event each lifecycle event is journaled as; None: not journaled.
JOURNALED: Mapping[Event, str | None] = MappingProxyType(
    {
        _E.JOIN: "added",
        _E.QUARANTINE: "quarantined",
        _E.SPARE: "spared",
        _E.EJECT: "ejected",
        _E.PASS: None,
        _E.READMIT: "readmitted",
        _E.DRAIN: "draining",
        _E.SETTLE: "drained",
        _E.UNDRAIN: "readmitted",
        _E.REMOVE: "removed",
    }
)

_EJECTED = frozenset({_S.NEW, _S.EJECTED, _S.HELD, _S.DRAINING_EJECTED})
_DRAINING = frozenset({_S.DRAINING, _S.DRAINING_EJECTED, _S.REMOVED})
_SHOWN: Mapping[Stage, EngineState] = MappingProxyType(
    {
        _S.NEW: EngineState.EJECTED,
        _S.ADMITTED: EngineState.ADMITTED,
        _S.QUARANTINED: EngineState.QUARANTINED,
        _S.EJECTED: EngineState.EJECTED,
        _S.HELD: EngineState.HELD,
    }
)

Emit = Callable[[EngineEvent], None]


class LifecycleError(Exception):
    """An event the engine's stage has no move for: a bug in the caller."""

    def __init__(self, engine: str, stage: Stage, event: Event) -> None:
        super().__init__(
            f"engine {engine}: no lifecycle transition for event {event.value!r} "
            f"in stage {stage.value!r}"
        )
        self.engine = engine
        self.stage = stage
        self.event = event


class Lifecycle:
    """One engine's stage and quarantine; `apply` is the only way to change them."""

    __slots__ = ("_stage", "_until", "engine")

    def __init__(self, engine: str, *, new: bool = False) -> None:
        """`engine`: its id, for the events; `new`: added at runtime (it starts `new`
        and joins; an engine from the config file starts admitted)."""
        self.engine = engine
        # Never QUARANTINED: a quarantine is ADMITTED (or DRAINING) with `_until` ahead.
        self._stage = Stage.NEW if new else Stage.ADMITTED
        self._until = 0.0

    # Readers --------------------------------------------------------------------

    @property
    def quarantined_until(self) -> float:
        """Event-loop time its last quarantine ends (0 if never quarantined)."""
        return self._until

    @property
    def ejected(self) -> bool:
        """Out of placement until readmission lets it back (whether drained or not)."""
        return self._stage in _EJECTED

    @property
    def held(self) -> bool:
        return self._stage is Stage.HELD

    @property
    def draining(self) -> bool:
        """Drained by an operator (or a source); only an undrain ends it."""
        return self._stage in _DRAINING

    def stage(self, now: float | None = None) -> Stage:
        """The stage at `now` (event-loop time); without it a running quarantine reads as
        admitted (the two move alike under every event)."""
        if self._stage is Stage.ADMITTED and now is not None and now < self._until:
            return Stage.QUARANTINED
        return self._stage

    def state(self, now: float, busy: bool) -> EngineState:
        """What an operator sees; `busy`: a request holds one of its seats."""
        stage = self.stage(now)
        if stage in _DRAINING:
            return EngineState.DRAINING if busy else EngineState.DRAINED
        return _SHOWN[stage]

    # The one writer -------------------------------------------------------------

    def apply(
        self,
        event: Event,
        emit: Emit,
        detail: str = "",
        *,
        now: float | None = None,
        until: float | None = None,
    ) -> Stage:
        """Move by `event`, then tell `emit` (the fleet's listeners) in the event's words
        (`detail`). `until`: a quarantine's end, event-loop time (required for one, and
        only for one). Returns the new stage at `now`; raises `LifecycleError` if the
        stage has no move for the event, with nothing changed."""
        current = self.stage(now)
        following = TRANSITIONS.get((current, event))
        if following is None:
            raise LifecycleError(self.engine, current, event)
        if (until is not None) != (event is Event.QUARANTINE):
            raise ValueError(f"`until` goes with a quarantine, not with {event.value!r}")
        if until is not None:
            self._until = max(self._until, until)
        self._stage = Stage.ADMITTED if following is Stage.QUARANTINED else following
        kind = JOURNALED[event]
        if kind is not None:
            emit(EngineEvent(kind, self.engine, detail))
        return self.stage(now)

    def __repr__(self) -> str:
        return f"Lifecycle({self.engine!r}, {self._stage.value}, until={self._until:g})"

"""An engine's lifecycle: the whole transition table, walked pair by pair, the timed
quarantine, and a drain laid over an ejection."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.fleet.lifecycle import (
    TRANSITIONS,
    EngineState,
    Event,
    Lifecycle,
    LifecycleError,
    Stage,
)
from narwhal.fleet.table import NOT_YET_PROBED, Engine, EngineEvent, Fleet

S, E = Stage, Event
NOW = 100.0

# Written out again here, not read from the module: the table as the docs promise it.
EXPECTED: dict[tuple[Stage, Event], Stage] = {
    (S.NEW, E.JOIN): S.EJECTED,
    (S.ADMITTED, E.QUARANTINE): S.QUARANTINED,
    (S.ADMITTED, E.SPARE): S.ADMITTED,
    (S.ADMITTED, E.EJECT): S.EJECTED,
    (S.ADMITTED, E.DRAIN): S.DRAINING,
    (S.QUARANTINED, E.QUARANTINE): S.QUARANTINED,
    (S.QUARANTINED, E.SPARE): S.QUARANTINED,
    (S.QUARANTINED, E.EJECT): S.EJECTED,
    (S.QUARANTINED, E.DRAIN): S.DRAINING,
    (S.EJECTED, E.PASS): S.HELD,
    (S.EJECTED, E.READMIT): S.ADMITTED,
    (S.EJECTED, E.DRAIN): S.DRAINING_EJECTED,
    (S.HELD, E.READMIT): S.ADMITTED,
    (S.HELD, E.DRAIN): S.DRAINING_EJECTED,
    (S.DRAINING, E.QUARANTINE): S.DRAINING,
    (S.DRAINING, E.SETTLE): S.DRAINING,
    (S.DRAINING, E.UNDRAIN): S.ADMITTED,
    (S.DRAINING, E.REMOVE): S.REMOVED,
    (S.DRAINING_EJECTED, E.SETTLE): S.DRAINING_EJECTED,
    (S.DRAINING_EJECTED, E.UNDRAIN): S.EJECTED,
    (S.DRAINING_EJECTED, E.REMOVE): S.REMOVED,
}

# The engine event each lifecycle event is journaled as (the journal's words).
KINDS: dict[Event, str | None] = {
    E.JOIN: "added",
    E.QUARANTINE: "quarantined",
    E.SPARE: "spared",
    E.EJECT: "ejected",
    E.PASS: None,
    E.READMIT: "readmitted",
    E.DRAIN: "draining",
    E.SETTLE: "drained",
    E.UNDRAIN: "readmitted",
    E.REMOVE: "removed",
}

# How to reach each stage from a fresh lifecycle (`new`: added at runtime).
PATHS: dict[Stage, tuple[bool, tuple[Event, ...]]] = {
    S.NEW: (True, ()),
    S.ADMITTED: (False, ()),
    S.QUARANTINED: (False, (E.QUARANTINE,)),
    S.EJECTED: (False, (E.EJECT,)),
    S.HELD: (False, (E.EJECT, E.PASS)),
    S.DRAINING: (False, (E.DRAIN,)),
    S.DRAINING_EJECTED: (False, (E.EJECT, E.DRAIN)),
    S.REMOVED: (False, (E.DRAIN, E.REMOVE)),
}


def ignore(_: EngineEvent) -> None:
    pass


def step(
    lifecycle: Lifecycle,
    event: Event,
    emit: Callable[[EngineEvent], None] = ignore,
    detail: str = "",
) -> Stage:
    until = NOW + 5.0 if event is E.QUARANTINE else None
    return lifecycle.apply(event, emit, detail, now=NOW, until=until)


def at(stage: Stage) -> Lifecycle:
    new, path = PATHS[stage]
    lifecycle = Lifecycle("e0", new=new)
    for event in path:
        step(lifecycle, event)
    assert lifecycle.stage(NOW) is stage
    return lifecycle


def test_the_table_is_the_documented_one() -> None:
    assert dict(TRANSITIONS) == EXPECTED


@pytest.mark.parametrize(("stage", "event"), sorted(EXPECTED))
def test_every_legal_move_lands_where_the_table_says_and_is_journaled(
    stage: Stage, event: Event
) -> None:
    lifecycle = at(stage)
    events: list[EngineEvent] = []
    landed = step(lifecycle, event, events.append, f"why {event.value}")
    assert landed is EXPECTED[stage, event]
    assert lifecycle.stage(NOW) is landed
    kind = KINDS[event]
    expected = [] if kind is None else [EngineEvent(kind, "e0", f"why {event.value}")]
    assert events == expected


ILLEGAL = sorted(set(itertools.product(Stage, Event)) - set(EXPECTED))


@pytest.mark.parametrize(("stage", "event"), ILLEGAL)
def test_every_other_pair_raises_naming_stage_and_event_and_changes_nothing(
    stage: Stage, event: Event
) -> None:
    lifecycle = at(stage)
    before = (lifecycle.stage(NOW), lifecycle.quarantined_until)
    events: list[EngineEvent] = []
    with pytest.raises(LifecycleError) as caught:
        step(lifecycle, event, events.append)
    message = str(caught.value)
    assert f"'{event.value}'" in message and f"'{stage.value}'" in message
    assert "engine e0" in message
    assert (caught.value.stage, caught.value.event) == (stage, event)
    assert (lifecycle.stage(NOW), lifecycle.quarantined_until) == before
    assert events == []


def test_until_goes_with_a_quarantine_and_only_with_one() -> None:
    lifecycle = Lifecycle("e0")
    with pytest.raises(ValueError, match="quarantine"):
        lifecycle.apply(E.QUARANTINE, ignore, now=NOW)
    with pytest.raises(ValueError, match="'eject'"):
        lifecycle.apply(E.EJECT, ignore, until=NOW)
    assert lifecycle.stage(NOW) is S.ADMITTED


# What an operator sees -------------------------------------------------------------


def test_engine_state_values_are_the_ones_the_state_page_shows() -> None:
    assert [s.value for s in EngineState] == [
        "admitted",
        "quarantined",
        "ejected",
        "held",
        "draining",
        "drained",
    ]


@pytest.mark.parametrize(
    ("stage", "idle", "busy"),
    [
        (S.NEW, "ejected", "ejected"),
        (S.ADMITTED, "admitted", "admitted"),
        (S.QUARANTINED, "quarantined", "quarantined"),
        (S.EJECTED, "ejected", "ejected"),
        (S.HELD, "held", "held"),
        (S.DRAINING, "drained", "draining"),
        (S.DRAINING_EJECTED, "drained", "draining"),
        (S.REMOVED, "drained", "draining"),
    ],
)
def test_each_stage_shows_as_an_engine_state(stage: Stage, idle: str, busy: str) -> None:
    lifecycle = at(stage)
    assert lifecycle.state(NOW, busy=False).value == idle
    assert lifecycle.state(NOW, busy=True).value == busy


@pytest.mark.parametrize(
    ("stage", "ejected", "held", "draining"),
    [
        (S.ADMITTED, False, False, False),
        (S.QUARANTINED, False, False, False),
        (S.EJECTED, True, False, False),
        (S.HELD, True, True, False),
        (S.DRAINING, False, False, True),
        (S.DRAINING_EJECTED, True, False, True),
    ],
)
def test_the_flags_readers_keep_reading(
    stage: Stage, ejected: bool, held: bool, draining: bool
) -> None:
    lifecycle = at(stage)
    assert (lifecycle.ejected, lifecycle.held, lifecycle.draining) == (ejected, held, draining)


# The timed quarantine ----------------------------------------------------------------


def test_a_quarantine_decays_back_to_admitted_at_its_time_with_no_event() -> None:
    lifecycle = Lifecycle("e0")
    events: list[EngineEvent] = []
    landed = lifecycle.apply(E.QUARANTINE, events.append, "5 s after silence", now=10, until=15)
    assert landed is S.QUARANTINED and lifecycle.quarantined_until == 15
    assert lifecycle.stage(14.999) is S.QUARANTINED
    assert lifecycle.state(14.999, busy=False) is EngineState.QUARANTINED
    assert lifecycle.stage(15.0) is S.ADMITTED
    assert lifecycle.state(15.0, busy=False) is EngineState.ADMITTED
    assert events == [EngineEvent("quarantined", "e0", "5 s after silence")]


def test_a_longer_quarantine_extends_a_shorter_one_does_not() -> None:
    lifecycle = Lifecycle("e0")
    lifecycle.apply(E.QUARANTINE, ignore, now=10, until=20)
    lifecycle.apply(E.QUARANTINE, ignore, now=11, until=30)
    assert lifecycle.quarantined_until == 30
    lifecycle.apply(E.QUARANTINE, ignore, now=12, until=13)
    assert lifecycle.quarantined_until == 30
    assert lifecycle.stage(29) is S.QUARANTINED


def test_an_expired_quarantine_is_admitted_for_every_move() -> None:
    lifecycle = Lifecycle("e0")
    lifecycle.apply(E.QUARANTINE, ignore, now=10, until=15)
    assert lifecycle.apply(E.SPARE, ignore, now=16) is S.ADMITTED
    assert lifecycle.apply(E.QUARANTINE, ignore, now=16, until=18) is S.QUARANTINED


def test_a_quarantine_runs_on_underneath_an_ejection_and_a_drain() -> None:
    lifecycle = Lifecycle("e0")
    lifecycle.apply(E.QUARANTINE, ignore, now=10, until=20)
    assert lifecycle.apply(E.EJECT, ignore, now=11) is S.EJECTED
    assert lifecycle.apply(E.READMIT, ignore, now=12) is S.QUARANTINED
    assert lifecycle.apply(E.DRAIN, ignore, now=13) is S.DRAINING
    # A draining engine's failures still quarantine it.
    lifecycle.apply(E.QUARANTINE, ignore, now=14, until=25)
    assert lifecycle.apply(E.UNDRAIN, ignore, now=15) is S.QUARANTINED
    assert lifecycle.stage(25) is S.ADMITTED


def test_without_a_time_a_quarantined_engine_moves_as_an_admitted_one() -> None:
    lifecycle = Lifecycle("e0")
    lifecycle.apply(E.QUARANTINE, ignore, now=10, until=20)
    assert lifecycle.apply(E.SPARE, ignore) is S.ADMITTED  # the stage as stored
    assert lifecycle.stage(11) is S.QUARANTINED
    assert lifecycle.apply(E.EJECT, ignore) is S.EJECTED


# A drain over an ejection ------------------------------------------------------------


def test_a_drain_overlays_an_ejection_and_an_undrain_leaves_it_standing() -> None:
    lifecycle = at(S.EJECTED)
    assert lifecycle.apply(E.DRAIN, ignore) is S.DRAINING_EJECTED
    assert lifecycle.ejected and lifecycle.draining
    assert lifecycle.state(NOW, busy=True) is EngineState.DRAINING
    assert lifecycle.state(NOW, busy=False) is EngineState.DRAINED
    # The breaker leaves a draining engine be; readmission never judges it.
    for event in (E.EJECT, E.SPARE, E.PASS, E.READMIT):
        with pytest.raises(LifecycleError):
            lifecycle.apply(event, ignore)
    assert lifecycle.apply(E.UNDRAIN, ignore) is S.EJECTED
    assert lifecycle.ejected and not lifecycle.draining


def test_a_held_engine_drained_leaves_its_wave_and_returns_ejected() -> None:
    lifecycle = at(S.HELD)
    assert lifecycle.apply(E.DRAIN, ignore) is S.DRAINING_EJECTED
    assert not lifecycle.held and lifecycle.ejected
    assert lifecycle.apply(E.UNDRAIN, ignore) is S.EJECTED


def test_a_drained_admitted_engine_undrains_admitted_and_a_removed_one_stays_removed() -> None:
    lifecycle = at(S.DRAINING)
    assert lifecycle.apply(E.UNDRAIN, ignore) is S.ADMITTED
    lifecycle.apply(E.DRAIN, ignore)
    assert lifecycle.apply(E.REMOVE, ignore) is S.REMOVED
    for event in Event:
        with pytest.raises(LifecycleError, match="'removed'"):
            lifecycle.apply(event, ignore, until=NOW if event is E.QUARANTINE else None)


# Through the fleet -------------------------------------------------------------------


def test_an_engine_added_at_runtime_starts_ejected_until_its_first_probe() -> None:
    fleet = Fleet([EngineSpec("p0", "http://10.0.0.1:1", Role.PREFILL)])
    events: list[EngineEvent] = []
    fleet.listeners.append(events.append)
    engine = fleet.add(EngineSpec("d9", "http://10.0.0.9:1", Role.DECODE), "a detail")
    assert engine.lifecycle.stage() is S.EJECTED and engine.ejected
    assert engine.ejection_reason == NOT_YET_PROBED
    assert events == [EngineEvent("added", "d9", "a detail")]
    assert fleet.by_id["p0"].lifecycle.stage() is S.ADMITTED


def test_the_engines_flags_are_read_only() -> None:
    engine = Engine(EngineSpec("d0", "http://10.0.0.3:1", Role.DECODE))
    for flag, value in (
        ("ejected", True),
        ("held", True),
        ("draining", True),
        ("quarantined_until", 1.0),
    ):
        with pytest.raises(AttributeError):
            setattr(engine, flag, value)
    assert not (engine.ejected or engine.held or engine.draining)
    assert engine.quarantined_until == 0.0

"""The breaker's rules: what counts, when a streak ejects, what resets it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.fleet.breaker import COUNTED, Breaker, counts, may_eject
from narwhal.fleet.models import Catalog, Target
from narwhal.fleet.table import EngineEvent, Fleet
from narwhal.protocol.errors import Cause, NarwhalError, client_error, engine_error


def fleet() -> Fleet:
    return Fleet(
        [
            EngineSpec("p0", "http://127.0.0.1:1", Role.PREFILL),
            EngineSpec("d0", "http://127.0.0.1:2", Role.DECODE),
        ]
    )


def fault(cause: Cause, engine: str = "d0", status: int | None = None) -> NarwhalError:
    return engine_error(cause, f"{cause} happened", engine, status=status)


@pytest.mark.parametrize("cause", sorted(COUNTED))
def test_every_engine_fault_kind_counts(cause: Cause) -> None:
    assert counts(fault(cause, status=500))


@pytest.mark.parametrize(
    "error",
    [
        client_error(400, "bad prompt"),
        fault(Cause.HTTP_STATUS, status=400),
        fault(Cause.ERROR_OBJECT, status=413),
        fault(Cause.HANDOFF_EXPIRED),
        NarwhalError(504, "deadline", Cause.DEADLINE),
        NarwhalError(503, "none", Cause.UNAVAILABLE),
    ],
)
def test_client_faults_and_router_decisions_do_not_count(error: NarwhalError) -> None:
    assert not counts(error)


def test_consecutive_failures_eject_at_the_threshold_with_a_reason() -> None:
    engines = fleet()
    events: list[EngineEvent] = []
    engines.listeners.append(events.append)
    breaker = Breaker(engines, eject_after=3, max_ejected_fraction=1.0)
    assert not breaker.failure(fault(Cause.SILENCE))
    assert not breaker.failure(fault(Cause.CLOSED_EARLY))
    assert breaker.failure(fault(Cause.FIRST_TOKEN_TIMEOUT), producer="p0")
    d0 = engines.by_id["d0"]
    assert d0.ejected and d0.ejections == 1 and d0.probe_producer == "p0"
    assert d0.ejection_reason is not None
    assert d0.ejection_reason.startswith("3 consecutive failures; last: first_token_timeout")
    assert [e.kind for e in events] == ["ejected"]


def test_a_success_resets_the_streak() -> None:
    engines = fleet()
    breaker = Breaker(engines, eject_after=2, max_ejected_fraction=1.0)
    breaker.failure(fault(Cause.SILENCE))
    breaker.success("d0")
    assert not breaker.failure(fault(Cause.SILENCE))
    assert not engines.by_id["d0"].ejected


def test_an_ejected_engine_is_not_ejected_twice() -> None:
    engines = fleet()
    breaker = Breaker(engines, eject_after=1, max_ejected_fraction=1.0)
    assert breaker.failure(fault(Cause.CONNECT))
    assert not breaker.failure(fault(Cause.CONNECT))
    assert engines.by_id["d0"].ejections == 1


def test_unknown_engines_are_ignored() -> None:
    assert not Breaker(fleet(), eject_after=1).failure(fault(Cause.CONNECT, engine="zz"))


# The cap on ejection (`max_ejected_fraction`) -------------------------------------------


@given(
    members=st.integers(1, 64),
    ejected=st.integers(0, 64),
    fraction=st.floats(0, 1, allow_nan=False),
)
def test_ejection_never_empties_a_phase_and_one_may_go_while_others_remain(
    members: int, ejected: int, fraction: float
) -> None:
    ejected = min(ejected, members)
    allowed = may_eject(members, ejected, fraction)
    if fraction < 1 and allowed:
        assert ejected + 1 < members  # never the whole phase
    if members > 1 and ejected == 0:
        assert allowed  # one may always go while others remain
    if allowed and ejected >= 1:
        assert ejected + 1 <= fraction * members + 1e-6  # past the first, the fraction holds
    if fraction == 1:
        assert allowed == (ejected < members)


@pytest.mark.parametrize(
    ("members", "ejected", "fraction", "allowed"),
    [
        (1, 0, 0.5, False),
        (1, 0, 1.0, True),
        (2, 0, 0.5, True),
        (2, 1, 0.5, False),
        (3, 0, 0.5, True),
        (3, 1, 0.5, False),
        (4, 1, 0.5, True),
        (4, 2, 0.5, False),
        (10, 0, 0.0, True),
        (10, 1, 0.0, False),
        (2, 1, 1.0, True),
        (1, 0, 0.9999999999999999, False),
        (3, 2, 0.9999999999999999, False),
    ],
)
def test_the_cap_table(members: int, ejected: int, fraction: float, allowed: bool) -> None:
    assert may_eject(members, ejected, fraction) is allowed


def test_the_last_engine_of_a_phase_is_spared_once_per_streak_and_stays_admitted() -> None:
    engines = fleet()
    events: list[EngineEvent] = []
    engines.listeners.append(events.append)
    breaker = Breaker(engines, eject_after=2)
    for _ in range(4):
        assert not breaker.failure(fault(Cause.HTTP_STATUS, status=500))
    d0 = engines.by_id["d0"]
    assert not d0.ejected and d0.spared and d0.spares == 1 and d0.streak == 4
    assert [e.kind for e in events] == ["spared"]
    assert "too few decode engines (recovery.max_ejected_fraction 0.5)" in events[0].detail
    breaker.success("d0")
    assert not d0.spared and d0.streak == 0
    for _ in range(2):
        breaker.failure(fault(Cause.SILENCE))
    assert d0.spares == 2


def test_an_engine_refusing_connections_is_ejected_even_when_last_of_its_phase() -> None:
    engines = fleet()
    breaker = Breaker(engines, eject_after=2)
    breaker.failure(fault(Cause.HTTP_STATUS, status=500))
    assert breaker.failure(fault(Cause.CONNECT))
    d0 = engines.by_id["d0"]
    assert d0.ejected and d0.refusing


def test_a_failure_after_a_connection_clears_refusing_and_a_success_does_too() -> None:
    engines = fleet()
    breaker = Breaker(engines, eject_after=5)
    breaker.failure(fault(Cause.CONNECT))
    assert engines.by_id["d0"].refusing
    breaker.failure(fault(Cause.SILENCE))
    assert not engines.by_id["d0"].refusing
    breaker.failure(fault(Cause.CONNECT))
    breaker.success("d0")
    assert not engines.by_id["d0"].refusing


def test_an_engine_serving_both_phases_is_capped_by_either() -> None:
    engines = Fleet(
        [
            EngineSpec("b0", "http://127.0.0.1:1", Role.BOTH),
            EngineSpec("b1", "http://127.0.0.1:2", Role.BOTH),
            EngineSpec("d0", "http://127.0.0.1:3", Role.DECODE),
        ]
    )
    breaker = Breaker(engines, eject_after=1)
    # Prefill has two members (b0, b1): one may go; then b1 is the last producer.
    assert breaker.failure(fault(Cause.SILENCE, engine="b0"))
    assert not breaker.failure(fault(Cause.SILENCE, engine="b1"))
    assert engines.by_id["b1"].spared


# The cap per pool: engines of one base model are counted together ---------------------


def two_pools() -> Fleet:
    """Two decode engines in each of two pools, and a producer in each."""
    return Fleet(
        [
            EngineSpec("pa", "http://127.0.0.1:1", Role.PREFILL, model="a"),
            EngineSpec("da0", "http://127.0.0.1:2", Role.DECODE, model="a"),
            EngineSpec("da1", "http://127.0.0.1:3", Role.DECODE, model="a"),
            EngineSpec("pb", "http://127.0.0.1:4", Role.PREFILL, model="b"),
            EngineSpec("db0", "http://127.0.0.1:5", Role.DECODE, model="b"),
            EngineSpec("db1", "http://127.0.0.1:6", Role.DECODE, model="b"),
        ],
        catalog=Catalog("a", {"b": Target("b")}),
    )


def test_the_cap_holds_within_each_pool() -> None:
    engines = two_pools()
    events: list[EngineEvent] = []
    engines.listeners.append(events.append)
    breaker = Breaker(engines, eject_after=1, max_ejected_fraction=0.5)
    # One of pool a's two consumers may go; then the other is the last of its pool, though
    # pool b's two are still admitted (over the fleet: one of four ejected).
    assert breaker.failure(fault(Cause.SILENCE, engine="da0"))
    assert not breaker.failure(fault(Cause.SILENCE, engine="da1"))
    assert engines.by_id["da1"].spared
    assert "too few decode engines of model `a` (recovery" in events[-1].detail


def test_an_ejection_in_one_pool_changes_nothing_for_another() -> None:
    engines = two_pools()
    breaker = Breaker(engines, eject_after=1, max_ejected_fraction=0.5)
    assert breaker.failure(fault(Cause.SILENCE, engine="da0"))
    assert breaker.failure(fault(Cause.CONNECT, engine="da1"))  # refusing: ejected anyway
    # Over the whole fleet two of four consumers are out, the cap; in pool b none is.
    assert breaker.failure(fault(Cause.SILENCE, engine="db0"))
    assert not breaker.failure(fault(Cause.SILENCE, engine="db1"))
    assert not engines.by_id["db1"].ejected


def test_a_pools_last_producer_is_spared_whatever_other_pools_hold() -> None:
    engines = two_pools()
    breaker = Breaker(engines, eject_after=1, max_ejected_fraction=0.5)
    # Fleet-wide there are two producers; pool a has one.
    assert not breaker.failure(fault(Cause.HTTP_STATUS, engine="pa", status=500))
    assert engines.by_id["pa"].spared and not engines.by_id["pa"].ejected

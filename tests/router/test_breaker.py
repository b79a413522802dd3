"""The breaker's rules: what counts, when a streak ejects, what resets it."""

from __future__ import annotations

import pytest

from narwhal.config import EngineSpec, Role
from narwhal.protocol.errors import Cause, NarwhalError, client_error, engine_error
from narwhal.router.breaker import COUNTED, Breaker, counts
from narwhal.router.fleet import EngineEvent, Fleet


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
    breaker = Breaker(engines, eject_after=3)
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
    breaker = Breaker(engines, eject_after=2)
    breaker.failure(fault(Cause.SILENCE))
    breaker.success("d0")
    assert not breaker.failure(fault(Cause.SILENCE))
    assert not engines.by_id["d0"].ejected


def test_an_ejected_engine_is_not_ejected_twice() -> None:
    engines = fleet()
    breaker = Breaker(engines, eject_after=1)
    assert breaker.failure(fault(Cause.CONNECT))
    assert not breaker.failure(fault(Cause.CONNECT))
    assert engines.by_id["d0"].ejections == 1


def test_unknown_engines_are_ignored() -> None:
    assert not Breaker(fleet(), eject_after=1).failure(fault(Cause.CONNECT, engine="zz"))

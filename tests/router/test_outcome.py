"""Blame and credit: how one leg's result reaches the breaker, quarantine, the engine's
failure counts and the retry budgets."""

from __future__ import annotations

import pytest

from narwhal.fleet.table import Phase
from narwhal.protocol.errors import Cause, NarwhalError, client_error, engine_error
from support.legs import FakeLegs, config, path

ENGINES = [("p0", "prefill"), ("d0", "decode")]


async def test_an_engine_fault_counts_against_the_engine_it_names() -> None:
    stack = path(config(ENGINES, recovery={"max_ejected_fraction": 1.0}), FakeLegs())
    reservation = await stack.fleet.reserve(frozenset(), None)
    error = engine_error(Cause.SILENCE, "silent", "d0")
    stack.outcome.failed(reservation, error)
    d0, p0 = stack.fleet.by_id["d0"], stack.fleet.by_id["p0"]
    assert d0.failures == {"silence": 1} and d0.streak == 1
    assert p0.failures == {} and p0.streak == 0
    # A crossed decode's failure remembers its producer, for readmission's probe.
    stack.outcome.failed(reservation, error)
    stack.outcome.failed(reservation, error)
    assert d0.ejected and d0.probe_producer == "p0"


@pytest.mark.parametrize(
    "error",
    [
        client_error(400, "bad prompt"),
        engine_error(Cause.HTTP_STATUS, "too long", "d0", status=400),
        NarwhalError(503, "no seat", Cause.UNAVAILABLE),
        engine_error(Cause.SILENCE, "unknown engine", "elsewhere"),
    ],
    ids=["client", "engine-4xx", "router", "unknown-engine"],
)
async def test_what_is_not_an_engines_fault_counts_against_nobody(error: NarwhalError) -> None:
    stack = path(config(ENGINES), FakeLegs())
    reservation = await stack.fleet.reserve(frozenset(), None)
    stack.outcome.failed(reservation, error)
    assert all(e.failures == {} and e.streak == 0 for e in stack.fleet.engines)


async def test_a_failure_quarantines_unless_the_handoff_merely_expired() -> None:
    stack = path(config(ENGINES, recovery={"failure_quarantine_s": 5}), FakeLegs())
    reservation = await stack.fleet.reserve(frozenset(), None)
    stack.outcome.failed(reservation, engine_error(Cause.HANDOFF_EXPIRED, "old", "p0"))
    assert stack.fleet.by_id["p0"].quarantines == 0
    stack.outcome.failed(reservation, engine_error(Cause.SILENCE, "silent", "d0"))
    assert stack.fleet.by_id["d0"].quarantines == 1


async def test_a_passed_prefill_clears_its_producer_and_a_fallback_has_none() -> None:
    stack = path(config(ENGINES), FakeLegs())
    reservation = await stack.fleet.reserve(frozenset(), None)
    p0, d0 = stack.fleet.by_id["p0"], stack.fleet.by_id["d0"]
    p0.streak = d0.streak = 2
    stack.outcome.passed(reservation, Phase.PREFILL)
    assert p0.streak == 0 and d0.streak == 2
    reservation.release()
    fallback = await stack.fleet.reserve(frozenset({"p0"}), None)
    assert fallback.fallback
    p0.streak = 2
    stack.outcome.passed(fallback, Phase.PREFILL)
    assert p0.streak == 2


async def test_an_answer_credits_the_retry_budget_and_a_tracked_one_the_continuations() -> None:
    settings = {"serving": {"retry_budget": 4, "retry_replenish": 0.5}}
    stack = path(
        config(ENGINES, continuation={"budget": 4, "replenish": 0.25}, **settings), FakeLegs()
    )
    budget, continuation = stack.outcome.budget, stack.outcome.continuation_budget
    budget.credit = continuation.credit = 1.0
    stack.outcome.answered(tracked=False)
    assert (budget.credit, continuation.credit) == (1.5, 1.0)
    stack.outcome.answered(tracked=True)
    assert (budget.credit, continuation.credit) == (2.0, 1.25)

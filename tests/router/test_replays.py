"""The rules every route's continuation shares for its replays' tries: where a replay may go,
what one more costs, what a failed one leaves, and the refusal each limit gives (its kind and
its words)."""

from __future__ import annotations

import pytest

from narwhal.config.continuation import ContinuationConfig
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.router.call import Call
from narwhal.router.replays import Replays
from support.legs import FakeLegs, Path, call, config, path

ENGINES = [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]
SETTINGS = ContinuationConfig(enabled=True, max_attempts=2, budget=5)
CUT = engine_error(Cause.CLOSED_EARLY, "engine d0 closed the stream early", "d0")


def replays(settings: ContinuationConfig = SETTINGS) -> tuple[Replays, Call, Path]:
    """The rules after d0, the answer's consumer, cut it."""
    stack = path(config(ENGINES), FakeLegs())
    record = call()
    rules = Replays(stack.fleet, stack.outcome, record, None, None, settings)
    rules.consumer_failed(CUT, "d0")
    return rules, record, stack


def refused(kind: str, why: str) -> tuple[str, str]:
    return kind, f"{CUT.message}; the answer was not continued: {why}"


async def test_the_failed_consumer_is_avoided_and_its_failure_is_the_one_a_refusal_names() -> None:
    rules, _, _ = replays()
    assert rules.avoid == {"d0"} and rules.failed_consumers == {"d0"}
    assert rules.error is CUT and rules.failed_at > 0


async def test_a_replay_goes_to_another_consumer_and_is_counted() -> None:
    rules, record, stack = replays()
    rules.spend(record)
    async with await rules.reserve(record) as reservation:
        assert reservation.consumer.id == "d1"
        rules.placed(record, reservation)
    assert record.continuations == 1
    assert stack.seats_held() == 0


async def test_the_consumer_that_failed_is_never_continued_on() -> None:
    rules, record, stack = replays()
    async with await stack.fleet.reserve(frozenset({"d1"}), None) as on_d0:
        with pytest.raises(NarwhalError) as raised:
            rules.placed(record, on_d0)
    assert (record.refused_kind, raised.value.message) == refused(
        "fleet", "no other consumer is available to continue on"
    )
    assert raised.value.engine == "d0" and raised.value.cause is Cause.CLOSED_EARLY
    assert record.continuations == 0


async def test_no_consumer_left_refuses_as_fleet() -> None:
    rules, record, stack = replays()
    for engine in list(stack.fleet.engines):
        if engine.id != "p0":
            stack.fleet.drain(engine, "test")
    with pytest.raises(NarwhalError) as raised:
        await rules.reserve(record)
    kind, message = refused("fleet", "no consumer was placed: ")
    assert record.refused_kind == kind and raised.value.message.startswith(message)
    assert stack.seats_held() == 0


async def test_continuation_max_attempts_refuses_as_budget() -> None:
    rules, record, stack = replays()
    record.continuations = 2
    credit = stack.outcome.continuation_budget.credit
    with pytest.raises(NarwhalError) as raised:
        rules.spend(record)
    assert (record.refused_kind, raised.value.message) == refused(
        "budget", "continuation.max_attempts (2) used"
    )
    # Refused before the budget is asked: no credit spent.
    assert stack.outcome.continuation_budget.credit == credit


async def test_a_spent_continuation_budget_refuses_as_budget() -> None:
    rules, record, stack = replays()
    stack.outcome.continuation_budget.credit = 0.0
    with pytest.raises(NarwhalError) as raised:
        rules.spend(record)
    assert (record.refused_kind, raised.value.message) == refused(
        "budget", "the router's continuation budget (continuation.budget) is spent"
    )


async def test_a_failed_replay_avoids_its_engines_and_a_consumer_for_good() -> None:
    rules, record, stack = replays()
    async with await stack.fleet.reserve(frozenset({"d0"}), None) as reservation:
        producer_fault = engine_error(Cause.PREFILL_TIMEOUT, "slow", "p0")
        rules.failed(record, producer_fault, reservation)
        assert rules.avoid == {"d0", "p0"} and rules.failed_consumers == {"d0"}
        consumer_fault = engine_error(Cause.SILENCE, "silent", "d1")
        rules.failed(record, consumer_fault, reservation)
    assert rules.failed_consumers == {"d0", "d1"}
    # The next refusal speaks of the latest failure.
    assert rules.error is consumer_fault

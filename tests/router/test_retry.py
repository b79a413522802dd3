"""The retry loop and its rules, against a fake engine client: when a failed try is tried
again and where, what stops the retries, and that every seat goes back on every path."""

from __future__ import annotations

import pytest

from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.whole_answer import WholeAnswer
from narwhal.protocol.errors import Cause, NarwhalError, client_error, engine_error
from narwhal.router.retry import FirstTries, worth_retrying
from support.legs import FakeLegs, FakeStream, call, config, path, request

ENGINES = [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")]


def fault(
    engine: str, cause: Cause = Cause.CLOSED_EARLY, status: int | None = None
) -> NarwhalError:
    return engine_error(cause, f"{engine}: {cause.value}", engine, status=status)


async def relay_ok(stream: DecodeStream) -> None:
    assert not stream.closed  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("transient", "attempts", "max_attempts", "now", "expected"),
    [
        (True, 1, 2, 0.0, True),
        (False, 1, 2, 0.0, False),  # a client's or a permanent fault
        (True, 2, 2, 0.0, False),  # attempts used
        (True, 1, 3, 10.0, False),  # the deadline has passed
        (True, 1, 3, 9.99, True),
    ],
)
def test_the_retry_decision(
    transient: bool, attempts: int, max_attempts: int, now: float, expected: bool
) -> None:
    error = NarwhalError(502, "x", Cause.CLOSED_EARLY, transient=transient, engine="d0")
    decided = worth_retrying(
        error, attempts=attempts, max_attempts=max_attempts, now=now, deadline=10.0
    )
    assert decided is expected


async def test_a_transient_failure_is_tried_again_away_from_the_engine_that_failed() -> None:
    legs = FakeLegs(faults={"p0": [fault("p0")], "p1": [fault("p1")]})
    stack = path(config(ENGINES, serving={"max_attempts": 3}), legs)
    record = call()
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 3)
    relayed = await stack.retries.run(record, tries, relay_ok)
    assert relayed.error is None
    assert record.attempts == 3
    # Each failed producer is avoided by every later try; the third try had none left,
    # so it was an aggregate fallback on a consumer (no prefill leg).
    assert [kind for kind, _ in legs.legs] == ["prefill", "prefill", "decode"]
    assert tries.failed_on == {"p0", "p1"}
    assert [e.engine for e in record.errors] == ["p0", "p1"]
    assert record.handoffs[-1] == "fallback"
    assert stack.fleet.by_id["p0"].failures == {"closed_early": 1}
    assert stack.outcome.budget.spent == 2
    assert stack.seats_held() == 0
    assert all(stream.closed for stream in legs.streams)


async def test_a_failure_the_client_caused_is_not_retried() -> None:
    legs = FakeLegs(faults={"p0": [fault("p0", Cause.HTTP_STATUS, status=400)]})
    stack = path(config(ENGINES[::2], serving={"max_attempts": 3}), legs)
    record = call()
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 3)
    with pytest.raises(NarwhalError) as raised:
        await stack.retries.run(record, tries, relay_ok)
    assert raised.value.status == 400
    assert record.attempts == 1 and stack.outcome.budget.spent == 0
    # A client's 4xx is not the engine's fault: nothing counts against it.
    assert stack.fleet.by_id["p0"].failures == {} and stack.fleet.by_id["p0"].streak == 0
    assert stack.seats_held() == 0


async def test_max_attempts_ends_the_retries_with_the_last_failure() -> None:
    legs = FakeLegs(faults={"d0": [fault("d0"), fault("d0", Cause.SILENCE)]})
    one_consumer = [("p0", "prefill"), ("d0", "decode")]
    stack = path(config(one_consumer, serving={"max_attempts": 2}), legs)
    record = call()
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 2)
    with pytest.raises(NarwhalError) as raised:
        await stack.retries.run(record, tries, relay_ok)
    assert raised.value.cause is Cause.SILENCE
    assert record.attempts == 2 and not record.retry_denied
    assert stack.fleet.by_id["d0"].failures == {"closed_early": 1, "silence": 1}
    assert stack.seats_held() == 0


async def test_a_spent_budget_denies_the_retry_and_says_so() -> None:
    legs = FakeLegs(faults={"p0": [fault("p0")]})
    settings = config(ENGINES, serving={"max_attempts": 3, "retry_budget": 0})
    stack = path(settings, legs)
    record = call()
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 3)
    with pytest.raises(NarwhalError):
        await stack.retries.run(record, tries, relay_ok)
    assert record.retry_denied and record.attempts == 1
    assert stack.outcome.budget.denied == 1
    assert stack.seats_held() == 0


async def test_a_failed_relay_is_judged_and_returned_not_retried() -> None:
    legs = FakeLegs()
    stack = path(config(ENGINES, serving={"max_attempts": 3}), legs)
    record = call()
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 3)
    cut = fault("d0")

    async def relay_cut(stream: DecodeStream) -> None:
        raise engine_error(cut.cause, cut.message, stream.engine)

    relayed = await stack.retries.run(record, tries, relay_cut)
    assert relayed.error is not None and relayed.error.engine == relayed.reservation.consumer.id
    assert record.attempts == 1 and stack.outcome.budget.spent == 0
    consumer = stack.fleet.by_id[relayed.reservation.consumer.id]
    assert consumer.failures == {"closed_early": 1} and consumer.streak == 1
    # The producer's leg had succeeded: its streak stays clear.
    assert stack.fleet.by_id[relayed.reservation.producer.id].streak == 0
    assert stack.seats_held() == 0
    assert isinstance(legs.streams[0], FakeStream) and legs.streams[0].closed


async def test_seats_go_back_when_the_request_is_cancelled_mid_relay() -> None:
    legs = FakeLegs()
    stack = path(config(ENGINES), legs)
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 1)

    async def relay_gone(stream: DecodeStream) -> None:
        raise ConnectionResetError

    with pytest.raises(ConnectionResetError):
        await stack.retries.run(call(), tries, relay_gone)
    assert stack.seats_held() == 0


async def test_an_answer_clears_both_engines_streaks() -> None:
    legs = FakeLegs()
    stack = path(config(ENGINES[::2]), legs)
    for engine in stack.fleet.engines:
        engine.streak = 2
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 1)
    relayed = await stack.retries.run(call(), tries, relay_ok)
    assert relayed.error is None
    assert [e.streak for e in stack.fleet.engines] == [0, 0]


def test_client_errors_are_never_transient() -> None:
    assert not client_error(400, "bad").transient


# Whole answers (`engine.nonstream_decode = "whole"`) -------------------------------------


async def forward_ok(answer: WholeAnswer) -> None:
    assert answer.body


async def test_a_failed_whole_leg_is_retried_elsewhere_as_a_failed_first_token_is() -> None:
    timeout = engine_error(Cause.FIRST_TOKEN_TIMEOUT, "no whole answer", "d0")
    legs = FakeLegs(faults={"d0": [timeout]}, whole_faults_after_send=True)
    stack = path(config(ENGINES, serving={"max_attempts": 2}), legs)
    record = call()
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 2)
    relayed = await stack.retries.run_whole(record, tries, forward_ok)
    assert relayed.error is None and relayed.stream.engine == "d1"
    assert [leg for leg in legs.legs if leg[0] == "whole"] == [("whole", "d0"), ("whole", "d1")]
    assert record.attempts == 2 and stack.outcome.budget.spent == 1
    assert stack.fleet.by_id["d0"].failures == {"first_token_timeout": 1}
    assert stack.fleet.by_id["d0"].streak == 1 and stack.fleet.by_id["d1"].streak == 0
    assert stack.seats_held() == 0


async def test_an_engines_client_error_on_a_whole_leg_keeps_its_status_and_is_not_retried() -> None:
    legs = FakeLegs(faults={"d0": [fault("d0", Cause.HTTP_STATUS, status=400)]})
    stack = path(config(ENGINES[::2], serving={"max_attempts": 3}), legs)
    record = call()
    tries = FirstTries(stack.fleet, request(), stack.outcome.budget, 3)
    with pytest.raises(NarwhalError) as raised:
        await stack.retries.run_whole(record, tries, forward_ok)
    assert raised.value.status == 400 and record.attempts == 1
    assert stack.fleet.by_id["d0"].failures == {} and stack.seats_held() == 0

"""One attempt against a fake engine client: the handoff kinds, the expiry bound, what a
dropped descriptor costs, and which leg is counted a success."""

from __future__ import annotations

import pytest

from narwhal.config.root import Config, parse_config
from narwhal.engines.client import LegBounds
from narwhal.engines.connector import PrefillResult
from narwhal.fleet.models import Target
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.router.abandoned import Abandonment
from narwhal.router.attempt import model_bounds
from support.legs import MODEL, WHOLE, FakeLegs, Path, call, config, path, request

ENGINES = [("p0", "prefill"), ("d0", "decode")]
LEASE = {"engine": {"kv_lease_s": 60}}


async def test_a_crossed_attempt_frees_the_prefill_seat_and_measures_the_first_token() -> None:
    legs = FakeLegs()
    stack = path(config(ENGINES), legs)
    record = call()
    reservation = await stack.fleet.reserve(frozenset(), None)
    async with reservation:
        await stack.attempt.run(record, request(), reservation)
        p0, d0 = stack.fleet.by_id["p0"], stack.fleet.by_id["d0"]
        # The prefill's seat went back once it answered; the decode's is held to the end.
        assert (p0.prefill_seats, d0.decode_seats) == (0, 1)
    assert stack.seats_held() == 0
    assert record.handoffs == ["crossed"] and d0.crossed_decodes == 1
    assert (record.producer, record.consumer, record.attempts) == ("p0", "d0", 1)
    assert record.prompt_tokens == 3
    assert record.ttft_s is not None and record.first_byte_s is not None
    assert len(record.backend_request_ids) == 1


async def test_a_continuing_attempt_keeps_the_requests_own_first_token_figures() -> None:
    stack = path(config(ENGINES), FakeLegs())
    record = call()
    async with await stack.fleet.reserve(frozenset(), None) as reservation:
        await stack.attempt.run(record, request(), reservation, rescue=True)
    assert record.ttft_s is None and record.first_byte_s is None and record.prompt_tokens is None


async def test_a_fallback_attempt_sends_no_prefill() -> None:
    legs = FakeLegs()
    stack = path(config(ENGINES), legs)
    record = call()
    async with await stack.fleet.reserve(frozenset({"p0"}), None) as reservation:
        assert reservation.fallback
        await stack.attempt.run(record, request(), reservation)
    assert legs.legs == [("decode", "d0")]
    assert record.handoffs == ["fallback"] and record.producer is None
    assert record.ttft_s == record.first_byte_s


async def test_an_old_descriptor_is_refused_and_its_blocks_released_through_a_consumer() -> None:
    # Past the bound (the lease less a sixth: 50 s) but inside the lease: blocks pinned.
    legs = FakeLegs(age_s=55.0)
    stack = path(config(ENGINES, **LEASE), legs)
    record = call()
    async with await stack.fleet.reserve(frozenset(), None) as reservation:
        with pytest.raises(NarwhalError) as raised:
            await stack.attempt.run(record, request(), reservation)
    assert raised.value.cause is Cause.HANDOFF_EXPIRED and raised.value.engine == "p0"
    assert "past the 50 s bound" in raised.value.message
    assert legs.legs == [("prefill", "p0")]
    assert [lost.producer for lost in record.abandoned] == ["p0"]
    assert len(stack.released) == 1


async def test_a_consumer_that_fails_before_the_descriptor_reaches_it_abandons_it() -> None:
    legs = FakeLegs(faults={"d0": [engine_error(Cause.CONNECT, "refused", "d0")]})
    stack = path(config(ENGINES, **LEASE), legs)
    stack.fleet.by_id["p0"].streak = 1
    record = call()
    async with await stack.fleet.reserve(frozenset(), None) as reservation:
        with pytest.raises(NarwhalError):
            await stack.attempt.run(record, request(), reservation)
    assert len(record.abandoned) == 1
    # The descriptor had passed validation: the producer's leg counts as a success.
    assert stack.fleet.by_id["p0"].streak == 0


async def test_a_producer_that_fails_is_not_counted_a_success() -> None:
    legs = FakeLegs(faults={"p0": [engine_error(Cause.PREFILL_TIMEOUT, "slow", "p0")]})
    stack = path(config(ENGINES), legs)
    stack.fleet.by_id["p0"].streak = 1
    async with await stack.fleet.reserve(frozenset(), None) as reservation:
        with pytest.raises(NarwhalError):
            await stack.attempt.run(call(), request(), reservation)
    assert stack.fleet.by_id["p0"].streak == 1
    assert stack.seats_held() == 0


# A decode asked for whole (`engine.nonstream_decode = "whole"`) --------------------------


async def test_a_whole_attempt_ends_at_the_answer_and_times_its_arrival() -> None:
    legs = FakeLegs()
    stack = path(config(ENGINES, engine={"whole_answer_timeout_s": 7}), legs)
    record = call()
    async with await stack.fleet.reserve(frozenset(), None) as reservation:
        answer = await stack.attempt.run_whole(record, request(), reservation)
        assert stack.fleet.by_id["d0"].decode_seats == 1
    assert answer.body == WHOLE and (answer.prompt_tokens, answer.completion_tokens) == (3, 2)
    assert legs.legs == [("prefill", "p0"), ("whole", "d0")] and legs.whole_timeouts == [7.0]
    assert record.handoffs == ["crossed"] and record.prompt_tokens == 3
    # The first token is the prefill's; the first byte is the whole answer's arrival.
    assert record.ttft_s is not None and record.first_byte_s is not None
    assert record.first_byte_s >= record.ttft_s
    assert stack.fleet.by_id["p0"].streak == 0 and not record.abandoned


async def test_a_whole_fallback_attempt_takes_the_answer_as_its_first_token() -> None:
    stack = path(config(ENGINES), FakeLegs())
    record = call()
    async with await stack.fleet.reserve(frozenset({"p0"}), None) as reservation:
        await stack.attempt.run_whole(record, request(), reservation)
    assert record.handoffs == ["fallback"] and record.ttft_s == record.first_byte_s


async def test_a_whole_leg_refused_before_its_request_went_out_abandons_the_descriptor() -> None:
    legs = FakeLegs(faults={"d0": [engine_error(Cause.CONNECT, "refused", "d0")]})
    stack = path(config(ENGINES, **LEASE), legs)
    record = call()
    async with await stack.fleet.reserve(frozenset(), None) as reservation:
        with pytest.raises(NarwhalError):
            await stack.attempt.run_whole(record, request(), reservation)
    assert [lost.producer for lost in record.abandoned] == ["p0"]
    assert len(stack.released) == 1


async def test_a_whole_leg_that_failed_after_its_request_went_out_abandons_nothing() -> None:
    timeout = engine_error(Cause.FIRST_TOKEN_TIMEOUT, "no whole answer", "d0")
    legs = FakeLegs(faults={"d0": [timeout]}, whole_faults_after_send=True)
    stack = path(config(ENGINES, **LEASE), legs)
    record = call()
    async with await stack.fleet.reserve(frozenset(), None) as reservation:
        with pytest.raises(NarwhalError) as raised:
            await stack.attempt.run_whole(record, request(), reservation)
    assert raised.value.status == 504 and raised.value.transient
    # The consumer may have pulled: the descriptor is never counted as abandoned.
    assert record.abandoned == [] and stack.released == []


@pytest.mark.parametrize(
    ("status", "releaser"), [(503, "the other"), (500, "the other"), (400, "the chosen")]
)
async def test_a_consumer_whose_own_fault_dropped_the_descriptor_is_the_last_to_release_it(
    status: int, releaser: str
) -> None:
    engines = [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]
    legs = FakeLegs()
    stack = path(config(engines, **LEASE), legs)
    starts = release_targets(stack)
    async with await stack.fleet.reserve(frozenset(), None) as reservation:
        chosen = reservation.consumer
        refusal = engine_error(Cause.HTTP_STATUS, "refused", chosen.id, status=status)
        legs.faults[chosen.id] = [refusal]
        with pytest.raises(NarwhalError):
            await stack.attempt.run(call(), request(), reservation)
    other = stack.fleet.by_id["d1" if chosen.id == "d0" else "d0"]
    # A client's 400 is no fault of the consumer: it releases the blocks as usual.
    assert starts == [(other if releaser == "the other" else chosen).url]


# Two pools: each model's own leg bounds, and releases within the handoff's pool -----------


def two_models(**b_engine: float) -> Config:
    """Pool `a` (the default model, no overrides) and pool `b` (with `b_engine`'s); pool
    b's engines listed first."""
    engines = [
        ("pb", "prefill", "b"),
        ("db", "decode", "b"),
        ("pa", "prefill", MODEL),
        ("da0", "decode", MODEL),
        ("da1", "decode", MODEL),
    ]
    return parse_config(
        {
            "model": MODEL,
            "engine": {
                "kv_lease_s": 60,
                "prefill_timeout_s": 40,
                "first_token_timeout_s": 4,
                "decode_read_timeout_s": 9,
                "whole_answer_timeout_s": 70,
            },
            "models": [{"name": MODEL}, {"name": "b", "engine": b_engine}],
            "engines": [
                {"id": name, "url": f"http://127.0.0.1:{9 + i}", "role": role, "model": model}
                for i, (name, role, model) in enumerate(engines)
            ],
        }
    )


def release_targets(stack: Path) -> list[str]:
    """The consumers the attempt asks to release handoffs, by url, in order."""
    starts: list[str] = []

    def start(consumer_url: str, result: PrefillResult, lost: Abandonment) -> None:
        starts.append(consumer_url)

    stack.attempt.releases.start = start  # type: ignore[method-assign]
    return starts


async def test_a_models_own_bounds_go_with_its_legs_and_others_take_the_clients() -> None:
    legs = FakeLegs()
    stack = path(two_models(first_token_timeout_s=0.5, whole_answer_timeout_s=3), legs)
    b_bounds = LegBounds(40, 0.5, 9, 3)
    assert model_bounds(stack.config) == {"b": b_bounds}
    for target in (Target("b"), Target(MODEL), Target("b")):
        async with await stack.fleet.reserve(frozenset(), None, target) as reservation:
            await stack.attempt.run(call(), request(), reservation)
        async with await stack.fleet.reserve(frozenset(), None, target) as reservation:
            await stack.attempt.run_whole(call(), request(), reservation)
    b, a = [("prefill", b_bounds), ("decode", b_bounds)], [("prefill", None), ("decode", None)]
    assert legs.bounds == [*b, b[0], *a, a[0], *b, b[0]]
    assert legs.whole_timeouts == [3.0, 70.0, 3.0]
    # One bounds object per model, made at startup: no request makes its own.
    assert legs.bounds[0][1] is legs.bounds[-1][1]


async def test_an_abandoned_handoff_is_released_through_a_consumer_of_its_own_pool() -> None:
    legs = FakeLegs()
    stack = path(two_models(), legs)
    starts = release_targets(stack)
    async with await stack.fleet.reserve(frozenset(), None, Target(MODEL)) as reservation:
        chosen = reservation.consumer
        assert chosen.model == MODEL
        # The chosen consumer refuses connections: the release needs another one.
        chosen.refusing = True
        legs.faults[chosen.id] = [engine_error(Cause.CONNECT, "refused", chosen.id)]
        with pytest.raises(NarwhalError):
            await stack.attempt.run(call(), request(), reservation)
    other = next(e for e in stack.fleet.engines if e.id in ("da0", "da1") and e is not chosen)
    # Pool b's consumer comes first in the fleet, but it could not free pa's blocks.
    assert starts == [other.url]


async def test_with_no_other_consumer_in_its_pool_a_handoff_waits_for_its_lease() -> None:
    legs = FakeLegs(faults={"db": [engine_error(Cause.CONNECT, "refused", "db")]})
    stack = path(two_models(), legs)
    starts = release_targets(stack)
    stack.fleet.by_id["db"].refusing = True
    record = call()
    async with await stack.fleet.reserve(frozenset(), None, Target("b")) as reservation:
        assert reservation.consumer.id == "db"
        with pytest.raises(NarwhalError):
            await stack.attempt.run(record, request(), reservation)
    assert [lost.producer for lost in record.abandoned] == ["pb"]
    assert starts == []

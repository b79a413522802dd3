"""The wait for a seat through `Fleet.reserve`: the scheduler's order, refusals made at
once, displacement, and the service rate fed as seats are released."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.fleet.scheduler import Claim
from narwhal.fleet.table import Fleet, Reservation
from narwhal.protocol.errors import NarwhalError

SPECS = (
    EngineSpec("p0", "http://10.0.0.1:1", Role.PREFILL),
    # One decode seat: one request at a time, the rest wait.
    EngineSpec("d0", "http://10.0.0.2:1", Role.DECODE, max_decode_seats=1),
)


def one_seat(queue_capacity: int = 1024) -> tuple[Fleet, Reservation]:
    fleet = Fleet(SPECS, queue_capacity=queue_capacity, queue_timeout_s=30.0)
    hold = fleet.try_reserve()
    assert hold is not None
    return fleet, hold


async def waiting(fleet: Fleet, claims: Sequence[Claim | None]) -> list[asyncio.Task[Reservation]]:
    """A waiter per claim, queued in this order."""
    tasks = []
    for claim in claims:
        tasks.append(asyncio.create_task(fleet.reserve(claim=claim)))
        await asyncio.sleep(0)
    return tasks


async def served_order(hold: Reservation, tasks: list[asyncio.Task[Reservation]]) -> list[int]:
    """Release the held seat again and again: the waiters' indices in the order served."""
    order: list[int] = []
    pending = set(tasks)
    current = hold
    while pending:
        current.release()
        done, _ = await asyncio.wait(pending, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        task = done.pop()
        pending.remove(task)
        order.append(tasks.index(task))
        current = task.result()
    current.release()
    return order


async def test_without_claims_waiters_are_served_in_arrival_order() -> None:
    fleet, hold = one_seat()
    tasks = await waiting(fleet, [None] * 6)
    assert fleet.queued == 6 and fleet.queued_by_tenant() == {"": 6}
    assert await served_order(hold, tasks) == [0, 1, 2, 3, 4, 5]
    assert fleet.queued == 0


async def test_with_nobody_waiting_a_request_goes_straight_to_a_seat() -> None:
    fleet = Fleet(SPECS)
    reservation = await fleet.reserve()
    assert reservation.cost == 1.0
    assert fleet._pools == {}, "no scheduler for a pool nobody waits for"
    reservation.release()
    reservation = await fleet.reserve(claim=Claim("chat", cost=420.0))
    assert reservation.cost == 420.0 and fleet._pools == {}
    reservation.release()


async def test_a_more_important_band_is_served_first_and_tenants_share_by_weight() -> None:
    fleet, hold = one_seat()
    batch = Claim("batch", priority=1, cost=100.0)
    heavy = Claim("heavy", weight=3.0, cost=100.0)
    light = Claim("light", weight=1.0, cost=100.0)
    tasks = await waiting(fleet, [batch, batch] + [light] * 4 + [heavy] * 12)
    assert fleet.queued_by_tenant() == {"batch": 2, "light": 4, "heavy": 12}
    order = await served_order(hold, tasks)
    assert order[-2:] == [0, 1], "band 1 waits for all of band 0"
    first = order[:8]
    assert sum(i >= 6 for i in first) == 6, "three heavy for each light"
    assert [i for i in order if i >= 6] == list(range(6, 18)), "a tenant's own in arrival order"


async def test_a_waiter_served_costs_its_claim_and_feeds_the_rate_while_others_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet, hold = one_seat()
    fed: list[tuple[object, float]] = []
    idle: list[object] = []
    monkeypatch.setattr(fleet._queues, "served", lambda key, cost, now: fed.append((key, cost)))
    monkeypatch.setattr(fleet._queues, "idle", lambda key: idle.append(key))
    tasks = await waiting(fleet, [Claim("a", cost=70.0), Claim("a", cost=30.0)])
    hold.release()
    first = await tasks[0]
    assert first.cost == 70.0
    first.release()
    second = await tasks[1]
    assert second.cost == 30.0
    second.release()
    # The held seat's end and the first's were while others waited; the last's was not.
    assert fed == [(None, 1.0), (None, 70.0)] and idle == [None]


async def test_a_more_important_request_displaces_a_waiter_of_a_less_important_band() -> None:
    fleet, hold = one_seat(queue_capacity=2)
    tasks = await waiting(
        fleet, [Claim("batch", priority=2), Claim("batch", priority=2), Claim("chat")]
    )
    with pytest.raises(NarwhalError) as caught:
        await tasks[1]
    error = caught.value
    assert error.status == 503 and error.retry_after is not None and error.retry_after >= 1
    assert error.message.startswith("shed: a more important request took its place")
    assert not tasks[0].done() and fleet.queued == 2
    # An equal band finds the queue full: fleet overload, 503 for a tenant's request.
    with pytest.raises(NarwhalError) as caught:
        await fleet.reserve(claim=Claim("bulk", priority=2))
    assert caught.value.status == 503 and caught.value.refusal == "queue_full"
    assert caught.value.message == (
        "the router's queue is full (2 requests wait for a seat; serving.queue_capacity)"
    )
    more = await waiting(fleet, [Claim("chat")])
    with pytest.raises(NarwhalError) as caught:
        await tasks[0]
    assert caught.value.message.startswith("shed: ")
    assert await served_order(hold, [tasks[2], more[0]]) == [0, 1]


async def test_a_request_that_would_wait_past_its_objective_is_refused_at_once() -> None:
    fleet, hold = one_seat()
    now = asyncio.get_running_loop().time()
    for n in range(5):  # the pool served 100 tokens a second while requests waited
        fleet._queues.served(None, 100.0, now - 4 + n)
    tasks = await waiting(fleet, [Claim("batch", cost=100.0)] * 10)
    with pytest.raises(NarwhalError) as caught:
        await fleet.reserve(claim=Claim("chat", cost=200.0, objective_s=1.0))
    error = caught.value
    # Ahead of it, its fair share of batch's: 200 tokens, at 100 a second.
    assert (error.status, error.retry_after) == (503, 2)
    assert error.message == "expected queue wait 2.0 s exceeds tenant `chat`'s ttft_objective_s 1 s"
    assert fleet.queued == 10
    late = Claim("chat", cost=50.0, deadline=asyncio.get_running_loop().time() + 0.2)
    with pytest.raises(NarwhalError) as caught:
        await fleet.reserve(claim=late)
    assert "left before its deadline" in caught.value.message
    assert await served_order(hold, tasks) == list(range(10))


async def test_a_tenant_over_its_queue_bound_is_429_rate_limit_exceeded() -> None:
    fleet, hold = one_seat()
    claim = Claim("batch", max_queued=2)
    tasks = await waiting(fleet, [claim, claim])
    with pytest.raises(NarwhalError) as caught:
        await fleet.reserve(claim=claim)
    error = caught.value
    assert (error.status, error.code, error.retry_after) == (429, "rate_limit_exceeded", 1)
    assert "tenant `batch`" in error.message and "max_queued" in error.message
    other = await waiting(fleet, [Claim("chat", max_queued=2)])
    assert await served_order(hold, tasks + other) == [0, 2, 1]


async def test_a_waiter_that_leaves_is_taken_out_of_its_tenants_queue() -> None:
    fleet, hold = one_seat()
    tasks = await waiting(fleet, [Claim("a"), Claim("b"), Claim("a"), Claim("b")])
    tasks[0].cancel()
    tasks[3].cancel()
    await asyncio.sleep(0)
    assert fleet.queued_by_tenant() == {"a": 1, "b": 1}
    assert await served_order(hold, tasks[1:3]) == [1, 0], "a's turn came first"


async def test_a_held_back_seat_goes_to_a_lighter_tenant_past_the_floods_queue() -> None:
    specs = (SPECS[0], EngineSpec("d0", "http://10.0.0.2:1", Role.DECODE, max_decode_seats=3))
    fleet = Fleet(specs, queue_timeout_s=30.0, reserved_seats=1)
    flood, light = Claim("flood"), Claim("light")
    held = [await fleet.reserve(claim=flood) for _ in range(2)]
    # The last seat is held back from the tenant holding the pool's seats.
    waiting_flood = await waiting(fleet, [flood])
    assert not waiting_flood[0].done() and fleet.queued == 1
    assert fleet.seat_reserve.held(None) == {"flood": 2}
    # A light tenant takes it at once, past the flood's waiter.
    seat = await asyncio.wait_for(fleet.reserve(claim=light), 5)
    assert fleet.seat_reserve.held(None) == {"flood": 2, "light": 1}
    seat.release()
    # Freed, the seat is held back again: still not the flood's.
    await asyncio.sleep(0)
    assert not waiting_flood[0].done()
    held[0].release()
    # With two free, the flood's waiter takes one and leaves the last held back.
    flood_seat = await asyncio.wait_for(waiting_flood[0], 5)
    assert fleet.seat_reserve.held(None) == {"flood": 2}
    for reservation in (flood_seat, held[1]):
        reservation.release()
    assert fleet.seat_reserve.held(None) == {}


async def test_without_held_back_seats_the_flood_takes_every_seat() -> None:
    specs = (SPECS[0], EngineSpec("d0", "http://10.0.0.2:1", Role.DECODE, max_decode_seats=3))
    fleet = Fleet(specs, queue_timeout_s=30.0)
    held = [await fleet.reserve(claim=Claim("flood")) for _ in range(3)]
    assert fleet.seat_reserve.held(None) == {} and all(r.claim is None for r in held)

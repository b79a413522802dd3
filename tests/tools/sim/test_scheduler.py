"""Capacity: seats and KV blocks, granted in arrival order, or by priority under the
priority policy."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.tools.sim.scheduler import Scheduler, SchedulingPolicy, Seat


async def test_seats_beyond_max_num_seqs_wait_in_order() -> None:
    scheduler = Scheduler(max_num_seqs=1, num_kv_blocks=10)
    first = await scheduler.admit(1)
    second = asyncio.create_task(scheduler.admit(1))
    third = asyncio.create_task(scheduler.admit(1))
    await asyncio.sleep(0)
    assert (scheduler.running, scheduler.waiting) == (1, 2)
    scheduler.release(first)
    await asyncio.sleep(0)
    assert second.done() and not third.done()
    scheduler.release(second.result())
    scheduler.release(await third)
    assert (scheduler.running, scheduler.waiting) == (0, 0)


async def test_a_large_request_at_the_head_blocks_smaller_ones_behind_it() -> None:
    scheduler = Scheduler(max_num_seqs=8, num_kv_blocks=10)
    first = await scheduler.admit(6)
    large = asyncio.create_task(scheduler.admit(8))
    small = asyncio.create_task(scheduler.admit(1))
    await asyncio.sleep(0)
    assert not large.done() and not small.done()
    assert scheduler.kv_usage == pytest.approx(0.6)
    scheduler.release(first)
    await asyncio.sleep(0)
    assert large.done() and small.done()


async def test_release_can_keep_leading_blocks_for_a_hold() -> None:
    scheduler = Scheduler(max_num_seqs=8, num_kv_blocks=10)
    seat = await scheduler.admit(4)
    kept = scheduler.release(seat, keep=3)
    assert len(set(kept)) == 3
    assert scheduler.kv_usage == pytest.approx(0.3)
    assert scheduler.release(seat) == []  # a seat ends once
    scheduler.free_blocks(kept)
    assert scheduler.kv_usage == 0


async def test_a_cancelled_wait_leaves_the_queue_and_lets_the_next_in() -> None:
    scheduler = Scheduler(max_num_seqs=8, num_kv_blocks=4)
    first = await scheduler.admit(3)
    large = asyncio.create_task(scheduler.admit(4))
    small = asyncio.create_task(scheduler.admit(1))
    await asyncio.sleep(0)
    large.cancel()
    async with asyncio.timeout(1):
        await small
    assert (scheduler.running, scheduler.waiting) == (2, 0)
    scheduler.release(first)


async def _queued(scheduler: Scheduler, *priorities: int) -> list[asyncio.Task[Seat]]:
    """One waiting request per priority, queued in the order given."""
    tasks = []
    for priority in priorities:
        tasks.append(asyncio.create_task(scheduler.admit(1, priority)))
        await asyncio.sleep(0)
    assert scheduler.waiting == len(priorities)
    return tasks


async def _admission_order(
    scheduler: Scheduler, first: Seat, tasks: list[asyncio.Task[Seat]]
) -> list[int]:
    """Free the one seat again and again: the indexes of `tasks` in the order admitted."""
    order: list[int] = []
    seat = first
    while len(order) < len(tasks):
        scheduler.release(seat)
        await asyncio.sleep(0)
        admitted = [i for i, task in enumerate(tasks) if task.done() and i not in order]
        assert len(admitted) == 1, "one seat: one admission at a time"
        order += admitted
        seat = tasks[admitted[0]].result()
    scheduler.release(seat)
    return order


async def test_the_priority_policy_admits_lower_priority_first_then_by_arrival() -> None:
    scheduler = Scheduler(max_num_seqs=1, num_kv_blocks=10, policy="priority")
    first = await scheduler.admit(1)
    tasks = await _queued(scheduler, 5, 0, -5, 0, 5)
    assert await _admission_order(scheduler, first, tasks) == [2, 1, 3, 0, 4]


async def test_fcfs_ignores_priority() -> None:
    scheduler = Scheduler(max_num_seqs=1, num_kv_blocks=10)
    first = await scheduler.admit(1)
    tasks = await _queued(scheduler, 5, 0, -5)
    assert await _admission_order(scheduler, first, tasks) == [0, 1, 2]


async def test_a_more_important_arrival_that_fits_goes_past_a_head_that_does_not() -> None:
    cases: list[tuple[SchedulingPolicy, bool]] = [("priority", True), ("fcfs", False)]
    for policy, passes in cases:
        scheduler = Scheduler(max_num_seqs=8, num_kv_blocks=4, policy=policy)
        first = await scheduler.admit(3)
        large = asyncio.create_task(scheduler.admit(4, 0))
        await asyncio.sleep(0)
        small = asyncio.create_task(scheduler.admit(1, -1))
        await asyncio.sleep(0)
        assert small.done() is passes, policy
        assert not large.done()
        # Not ahead of the head: it waits behind it, whatever the policy.
        later = asyncio.create_task(scheduler.admit(1, 1))
        await asyncio.sleep(0)
        assert not later.done()
        scheduler.release(first)
        if passes:
            scheduler.release(await small)
        async with asyncio.timeout(1):
            scheduler.release(await large)
            scheduler.release(await later)
        if not passes:
            scheduler.release(await small)
        assert (scheduler.running, scheduler.waiting, scheduler.kv_usage) == (0, 0, 0)


async def test_a_cancelled_wait_leaves_the_priority_queue() -> None:
    scheduler = Scheduler(max_num_seqs=1, num_kv_blocks=10, policy="priority")
    first = await scheduler.admit(1)
    tasks = await _queued(scheduler, 1, -1, 0)
    tasks[1].cancel()
    await asyncio.sleep(0)
    assert scheduler.waiting == 2
    scheduler.release(first)
    await asyncio.sleep(0)
    assert tasks[2].done() and not tasks[0].done()
    scheduler.release(tasks[2].result())
    scheduler.release(await tasks[0])

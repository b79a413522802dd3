"""Capacity: seats and KV blocks, granted in arrival order."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.tools.sim.scheduler import Scheduler


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

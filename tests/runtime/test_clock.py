"""The coarse clock: callbacks never early, at most one slot late, never after a cancel;
its `Timeout` behaves as `asyncio.timeout` does for the cancellations it did not cause."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.runtime.clock import GRANULARITY_S, Clock, Pending, clock


class _Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _FakeLoop:
    """A loop whose time moves only when told, firing its timers at their own times."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, int, _Handle, Callable[[], None]]] = []
        self.order = itertools.count()
        self.errors: list[dict[str, Any]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        handle = _Handle()
        heapq.heappush(self.timers, (when, next(self.order), handle, callback))
        return handle

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        self.errors.append(context)

    def advance(self, to: float) -> None:
        while self.timers and self.timers[0][0] <= to:
            when, _, handle, callback = heapq.heappop(self.timers)
            if not handle.cancelled:
                self.now = max(self.now, when)
                callback()
        self.now = to

    @property
    def live_timers(self) -> int:
        return sum(not handle.cancelled for _, _, handle, _ in self.timers)


def _fake_clock() -> tuple[_FakeLoop, Clock]:
    loop = _FakeLoop()
    return loop, Clock(cast(asyncio.AbstractEventLoop, loop))


_steps = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.floats(0.0, 2.0)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("advance"), st.floats(0.0, 0.5)),
    ),
    max_size=60,
)


@given(_steps)
def test_each_callback_runs_once_in_its_slot_unless_cancelled(steps: list[tuple[str, Any]]) -> None:
    loop, timers = _fake_clock()
    due: list[float] = []
    ran: dict[int, float] = {}
    cancelled: set[int] = set()
    handles: list[Pending] = []

    def record(index: int) -> Callable[[], object]:
        return lambda: ran.setdefault(index, loop.now)

    for action, value in steps:
        if action == "add":
            index = len(due)
            due.append(loop.now + value)
            handles.append(timers.call_at(due[index], record(index)))
        elif action == "cancel" and handles:
            index = value % len(handles)
            if index not in ran:
                cancelled.add(index)
            handles[index].cancel()
        else:
            loop.advance(loop.now + value)
    loop.advance(loop.now + 3.0)
    assert set(ran) == set(range(len(due))) - cancelled
    for index, at in ran.items():
        assert due[index] <= at <= due[index] + GRANULARITY_S + 1e-9
    assert timers.pending == 0
    # Nothing waits, so nothing keeps the loop's timer armed.
    assert loop.live_timers == 0


def test_one_loop_timer_serves_many_callbacks() -> None:
    loop, timers = _fake_clock()
    for index in range(1000):
        timers.call_at(5.0 + index / 1000, lambda: None)
    assert loop.live_timers == 1


def test_long_timeouts_cancelled_early_leave_few_slots_behind() -> None:
    # A request's 600 s deadline, cancelled when it ends 50 ms later, 200,000 times.
    loop, timers = _fake_clock()
    for _ in range(200_000):
        timers.call_at(loop.now + 600.0, lambda: None).cancel()
        loop.advance(loop.now + 0.05)
    assert timers.pending == 0
    assert timers.slots_held <= 2 * 1 + 64 + 1


def test_an_earlier_callback_rearms_the_loop_timer() -> None:
    loop, timers = _fake_clock()
    ran: list[str] = []
    timers.call_at(10.0, lambda: ran.append("late"))
    timers.call_at(0.5, lambda: ran.append("early"))
    loop.advance(1.0)
    assert ran == ["early"]
    loop.advance(11.0)
    assert ran == ["early", "late"]


def test_a_callback_cancelling_another_of_its_slot_stops_it() -> None:
    loop, timers = _fake_clock()
    ran: list[str] = []
    second: list[Pending] = []

    def first() -> None:
        ran.append("first")
        second[0].cancel()

    timers.call_at(1.0, first)
    second.append(timers.call_at(0.995, lambda: ran.append("second")))
    loop.advance(2.0)
    assert ran == ["first"]


def test_a_failing_callback_is_reported_and_the_rest_still_run() -> None:
    loop, timers = _fake_clock()
    ran: list[str] = []

    def fail() -> None:
        raise ValueError("boom")

    timers.call_at(1.0, fail)
    timers.call_at(1.0, lambda: ran.append("after"))
    loop.advance(2.0)
    assert ran == ["after"]
    assert [type(error["exception"]) for error in loop.errors] == [ValueError]


def test_a_callback_added_while_slots_run_is_kept() -> None:
    loop, timers = _fake_clock()
    ran: list[float] = []
    timers.call_at(1.0, lambda: timers.call_at(1.5, lambda: ran.append(loop.now)))
    loop.advance(3.0)
    assert len(ran) == 1 and 1.5 <= ran[0] <= 1.5 + GRANULARITY_S + 1e-9


# The timeout block, on the real loop -------------------------------------------------------


async def test_a_timeout_raises_timeout_error_when_due_and_not_before() -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0)
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with clock().timeout(0.05):
            await asyncio.sleep(30)
    # Loop times are floats of tens of thousands of seconds: their difference carries a
    # rounding error of about 1e-12 (seen: 29058.87 - 29058.82 = 0.04999999999927).
    assert loop.time() - started >= 0.05 - 1e-9
    assert clock().pending == 0


async def test_a_block_that_ends_in_time_leaves_nothing_waiting() -> None:
    async with clock().timeout(30) as block:
        await asyncio.sleep(0)
    assert not block.expired()
    assert clock().pending == 0


async def test_a_cancellation_from_outside_is_not_a_timeout() -> None:
    entered = asyncio.Event()

    async def waits() -> None:
        async with clock().timeout(30):
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(waits())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert clock().pending == 0


async def test_an_outer_timeout_is_the_outer_blocks_alone() -> None:
    reached: list[str] = []
    with pytest.raises(TimeoutError):
        async with clock().timeout(0.05) as outer:
            try:
                async with clock().timeout(30) as inner:
                    await asyncio.sleep(30)
            except TimeoutError:
                reached.append("inner raised TimeoutError")
    assert outer.expired() and not inner.expired()
    assert reached == []


async def test_an_inner_timeout_leaves_the_outer_block_running() -> None:
    async with clock().timeout(30) as outer:
        with pytest.raises(TimeoutError):
            async with clock().timeout(0.05):
                await asyncio.sleep(30)
        await asyncio.sleep(0)
    assert not outer.expired()
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0

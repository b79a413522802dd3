"""The request path's timeouts, kept on one coarse clock per event loop.

A request holds five timeouts (its deadline, the prefill's, the first token's, the decode
stream's silence watchdog, its connection's idle timer), and nearly all of them are
cancelled long before they are due. On uvloop, `asyncio.timeout` costs about 3.6 µs and a
loop timer about 2.2 µs to arm and cancel; here a timeout is an entry in the bucket of its
`GRANULARITY_S` slot, cancelled by deleting it, and a single loop timer, armed at the
earliest slot holding entries, runs whatever is due. A timeout never fires early and at
most one slot late, which is nothing beside timeouts of seconds.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable
from types import TracebackType
from weakref import WeakKeyDictionary

GRANULARITY_S = 0.01


class Pending:
    """A callback waiting in its slot; `cancel` takes it out."""

    __slots__ = ("_clock", "_slot", "callback", "live")

    def __init__(self, clock: Clock, slot: int, callback: Callable[[], object]) -> None:
        self._clock = clock
        self._slot = slot
        self.callback = callback
        self.live = True

    def cancel(self) -> None:
        if self.live:
            self.live = False
            self._clock._remove(self._slot, self)


class Clock:
    """Callbacks due at loop times, run from slots of `granularity` seconds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, granularity: float = GRANULARITY_S):
        self.loop = loop
        self.granularity = granularity
        self._slots: dict[int, dict[Pending, None]] = {}
        self._order: list[int] = []  # a heap of slots, some of them emptied since
        self._armed: int | None = None  # the slot the loop timer is set for
        self._timer: asyncio.TimerHandle | None = None

    def call_at(self, when: float, callback: Callable[[], object]) -> Pending:
        """Run `callback` once the loop time has passed `when` (at most a slot late)."""
        slot = math.ceil(when / self.granularity)
        bucket = self._slots.get(slot)
        if bucket is None:
            bucket = self._slots[slot] = {}
            order = self._order
            if len(order) > 2 * len(self._slots) + 64:
                # Mostly emptied slots, as with long timeouts nearly always cancelled: the
                # heap is rebuilt from the live ones, so it never holds many more.
                order[:] = self._slots
                heapq.heapify(order)
            else:
                heapq.heappush(order, slot)
            if self._armed is None or slot < self._armed:
                self._arm(slot)
        pending = Pending(self, slot, callback)
        bucket[pending] = None
        return pending

    def timeout_at(self, when: float) -> Timeout:
        """As `asyncio.timeout_at`: the task is cancelled at `when` and the block raises
        TimeoutError."""
        return Timeout(self, when)

    def timeout(self, delay: float) -> Timeout:
        return Timeout(self, self.loop.time() + delay)

    @property
    def pending(self) -> int:
        """How many callbacks wait."""
        return sum(map(len, self._slots.values()))

    @property
    def slots_held(self) -> int:
        """How many slots the heap holds, emptied ones included."""
        return len(self._order)

    def _remove(self, slot: int, pending: Pending) -> None:
        bucket = self._slots.get(slot)
        if bucket is None:
            return  # its slot is being run
        del bucket[pending]
        if not bucket:
            # The slot stays in the heap; it is skipped when reached.
            del self._slots[slot]

    def _arm(self, slot: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed = slot
        self._timer = self.loop.call_at(slot * self.granularity, self._run)

    def _run(self) -> None:
        self._armed = self._timer = None
        now = self.loop.time()
        order = self._order
        while order:
            slot = order[0]
            if slot not in self._slots:
                heapq.heappop(order)
                continue
            if slot * self.granularity > now:
                self._arm(slot)
                return
            heapq.heappop(order)
            for pending in self._slots.pop(slot):
                # One callback may cancel another of the same slot.
                if pending.live:
                    pending.live = False
                    try:
                        pending.callback()
                    except Exception as exc:
                        self.loop.call_exception_handler(
                            {"message": "timeout callback failed", "exception": exc}
                        )


class Timeout:
    """The block of `Clock.timeout_at`: cancels its task when due, and turns that
    cancellation (only that one) into TimeoutError."""

    __slots__ = ("_cancelling", "_clock", "_expired", "_pending", "_task", "when")

    def __init__(self, clock: Clock, when: float) -> None:
        self._clock = clock
        self.when = when
        self._expired = False
        self._pending: Pending | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> Timeout:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a timeout must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._pending = self._clock.call_at(self.when, self._expire)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._expired:
            assert self._pending is not None
            self._pending.cancel()
            return
        assert self._task is not None
        # Our cancel is taken back; a cancellation requested by anyone else stands.
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def expired(self) -> bool:
        return self._expired

    def _expire(self) -> None:
        self._expired = True
        assert self._task is not None
        self._task.cancel()


_clocks: WeakKeyDictionary[asyncio.AbstractEventLoop, Clock] = WeakKeyDictionary()


def clock() -> Clock:
    """The running loop's clock."""
    loop = asyncio.get_running_loop()
    found = _clocks.get(loop)
    if found is None:
        found = _clocks[loop] = Clock(loop)
    return found

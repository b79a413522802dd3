"""Capacity: running seats (at most max_num_seqs) and the KV block pool, with a waiting queue.

A request takes a seat with all the KV blocks it can need (prompt and output) before it
runs, so it never has to be preempted; requests that do not fit wait. The queue's order is
vLLM's `--scheduling-policy`: `fcfs` by arrival, `priority` by the request's `priority`
(lower first), then arrival, as vLLM 0.32's `PriorityRequestQueue` orders its waiting
requests. Under `fcfs` the priority is ignored, as vLLM ignores it. Unlike vLLM, nothing
running is preempted for a more important arrival: a seat holds its blocks to the end.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(slots=True, eq=False)
class Seat:
    """A running request's place and the KV block ids it owns."""

    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Waiter:
    blocks: int
    admitted: asyncio.Future[Seat]
    # When it joined the queue (event-loop seconds).
    since: float = 0.0


# A waiting request's place in the queue, a heap: (priority, arrival number, waiter). The
# arrival numbers are unique, so two waiters are never compared.
_Entry = tuple[int, int, _Waiter]


class Scheduler:
    """Admits requests in the policy's order while seats and KV blocks last."""

    def __init__(
        self, max_num_seqs: int, num_kv_blocks: int, policy: SchedulingPolicy = "fcfs"
    ) -> None:
        self._max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.policy = policy
        self._free_blocks: deque[int] = deque(range(num_kv_blocks))
        self._running: set[Seat] = set()
        self._waiting: list[_Entry] = []
        self._arrivals = itertools.count()
        # Seconds admitted requests waited in the queue, and how many were admitted (vLLM's
        # `vllm:request_queue_time_seconds` sum and count).
        self.queue_time_sum = 0.0
        self.queue_time_count = 0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool in use, held blocks included (vLLM reports 0..1)."""
        return 1 - len(self._free_blocks) / self.num_kv_blocks

    async def admit(self, blocks: int, priority: int = 0) -> Seat:
        """Wait for a seat with `blocks` KV blocks, in the queue's order (`priority` counts
        under the priority policy only); cancelling the wait leaves the queue."""
        band = priority if self.policy == "priority" else 0
        arrival = next(self._arrivals)
        # Straight in when nothing waiting comes first: under fcfs only an empty queue.
        if (not self._waiting or (band, arrival) < self._waiting[0][:2]) and self._fits(blocks):
            self.queue_time_count += 1
            return self._seat(blocks)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(blocks, loop.create_future(), loop.time())
        heapq.heappush(self._waiting, (band, arrival, waiter))
        try:
            return await waiter.admitted
        except asyncio.CancelledError:
            if waiter.admitted.cancelled():
                # Not admitted: leave the queue, which may let the next in line through.
                self._leave(waiter)
                self._admit_waiting()
            else:
                self.release(waiter.admitted.result())
            raise

    def release(self, seat: Seat, *, keep: int = 0) -> list[int]:
        """End a seat, freeing its blocks except the first `keep`, which are returned."""
        if seat not in self._running:
            return []
        self._running.discard(seat)
        kept, freed = seat.block_ids[:keep], seat.block_ids[keep:]
        seat.block_ids = []
        self.free_blocks(freed)
        return kept

    def free_blocks(self, block_ids: list[int]) -> None:
        """Return blocks to the pool (from a seat or a hold) and admit whoever now fits."""
        self._free_blocks.extend(block_ids)
        self._admit_waiting()

    def _fits(self, blocks: int) -> bool:
        return len(self._running) < self._max_num_seqs and blocks <= len(self._free_blocks)

    def _seat(self, blocks: int) -> Seat:
        seat = Seat([self._free_blocks.popleft() for _ in range(blocks)])
        self._running.add(seat)
        return seat

    def _leave(self, waiter: _Waiter) -> None:
        kept = [entry for entry in self._waiting if entry[2] is not waiter]
        if len(kept) < len(self._waiting):
            self._waiting = kept
            heapq.heapify(self._waiting)

    def _admit_waiting(self) -> None:
        # The head of the queue blocks those behind it (no skipping ahead to what fits).
        while self._waiting and self._fits(self._waiting[0][2].blocks):
            waiter = heapq.heappop(self._waiting)[2]
            if not waiter.admitted.cancelled():
                self.queue_time_count += 1
                self.queue_time_sum += asyncio.get_running_loop().time() - waiter.since
                waiter.admitted.set_result(self._seat(waiter.blocks))

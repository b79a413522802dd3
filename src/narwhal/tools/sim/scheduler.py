"""Capacity: running seats (at most max_num_seqs) and the KV block pool, with a FIFO queue.

A request takes a seat with all the KV blocks it can need (prompt and output) before it
runs, so it never has to be preempted; requests that do not fit wait in arrival order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


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


class Scheduler:
    """Admits requests in FIFO order while seats and KV blocks last."""

    def __init__(self, max_num_seqs: int, num_kv_blocks: int) -> None:
        self._max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self._free_blocks: deque[int] = deque(range(num_kv_blocks))
        self._running: set[Seat] = set()
        self._waiting: deque[_Waiter] = deque()
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

    async def admit(self, blocks: int) -> Seat:
        """Wait for a seat with `blocks` KV blocks; cancelling the wait leaves the queue."""
        if not self._waiting and self._fits(blocks):
            self.queue_time_count += 1
            return self._seat(blocks)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(blocks, loop.create_future(), loop.time())
        self._waiting.append(waiter)
        try:
            return await waiter.admitted
        except asyncio.CancelledError:
            if waiter.admitted.cancelled():
                # Not admitted: leave the queue, which may let the next in line through.
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
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

    def _admit_waiting(self) -> None:
        while self._waiting and self._fits(self._waiting[0].blocks):
            waiter = self._waiting.popleft()
            if not waiter.admitted.cancelled():
                self.queue_time_count += 1
                self.queue_time_sum += asyncio.get_running_loop().time() - waiter.since
                waiter.admitted.set_result(self._seat(waiter.blocks))

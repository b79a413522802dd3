"""Abandoned handoffs: prefills whose blocks a producer holds for a decode that never came.

A producer keeps a prefill's KV blocks until a consumer pulls them or the engine's KV
lease (`engine.kv_lease_s`) runs out. When the router drops a descriptor without
delivering it to a consumer, nobody will pull: the blocks stay pinned for the rest of the
lease. This module is the pure accounting of that cost, per producer: how many handoffs,
how many blocks, how many block-seconds, and how many blocks are still pinned now.
Times are event-loop seconds, the clock a descriptor's age is measured on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import orjson

from narwhal.protocol.descriptor import block_ids_ok


def block_count(descriptor: bytes | None) -> int:
    """The KV blocks a descriptor names: its `remote_block_ids`, flat or one list per
    KV-cache group (each group's blocks are held). 0 when they are absent or malformed:
    there is nothing sound to count."""
    if descriptor is None:
        return 0
    try:
        params = orjson.loads(descriptor)
    except orjson.JSONDecodeError:
        return 0
    ids = params.get("remote_block_ids") if isinstance(params, dict) else None
    if not isinstance(ids, list) or not block_ids_ok(ids):
        return 0
    return sum(len(item) if isinstance(item, list) else 1 for item in ids)


@dataclass(frozen=True, slots=True)
class Abandonment:
    """One dropped descriptor: its producer, its blocks, and the lease they had left."""

    producer: str
    blocks: int
    # Seconds of lease left when the descriptor was dropped (0 once past the lease).
    pinned_s: float
    expires_at: float

    @property
    def block_seconds(self) -> float:
        return self.blocks * self.pinned_s


def abandonment(
    producer: str, descriptor: bytes | None, started_at: float, now: float, lease_s: float
) -> Abandonment | None:
    """What dropping `descriptor` at `now` costs its producer; None when it pins nothing
    (no descriptor: a same-worker, fallback or recomputed handoff).

    The lease is counted from `started_at`, when the prefill was sent: the producer's own
    lease starts a little later, so this never overstates what is pinned.
    """
    if descriptor is None:
        return None
    expires_at = started_at + lease_s
    return Abandonment(producer, block_count(descriptor), max(0.0, expires_at - now), expires_at)


@dataclass(slots=True)
class ProducerTally:
    """One producer's abandoned handoffs since the router started."""

    handoffs: int = 0
    blocks: int = 0
    block_seconds: float = 0.0
    # (expires_at, blocks) of abandonments whose lease may still be running.
    live: deque[tuple[float, int]] = field(default_factory=deque)

    def pinned(self, now: float) -> int:
        """Blocks of abandoned handoffs still within their lease at `now`."""
        while self.live and self.live[0][0] <= now:
            self.live.popleft()
        return sum(blocks for _, blocks in self.live)


class AbandonedHandoffs:
    """Every producer's tally; `record` is told each abandonment once."""

    def __init__(self) -> None:
        self.by_producer: dict[str, ProducerTally] = {}

    def record(self, lost: Abandonment) -> None:
        tally = self.tally(lost.producer)
        tally.handoffs += 1
        tally.blocks += lost.blocks
        tally.block_seconds += lost.block_seconds
        if lost.pinned_s > 0 and lost.blocks:
            # Leases share one length, so expiries mostly arrive in order; an insertion
            # keeps the deque sorted when they do not.
            live = tally.live
            index = len(live)
            while index and live[index - 1][0] > lost.expires_at:
                index -= 1
            live.insert(index, (lost.expires_at, lost.blocks))

    def tally(self, producer: str) -> ProducerTally:
        tally = self.by_producer.get(producer)
        if tally is None:
            tally = self.by_producer[producer] = ProducerTally()
        return tally

    def summary(self, producer: str, now: float) -> dict[str, float | int]:
        """One producer's figures for `/narwhal/state`."""
        tally = self.by_producer.get(producer) or ProducerTally()
        return {
            "handoffs": tally.handoffs,
            "blocks": tally.blocks,
            "block_seconds": round(tally.block_seconds, 3),
            "pinned_blocks": tally.pinned(now),
        }


def journal_field(lost: list[Abandonment]) -> dict[str, object]:
    """A request's abandoned handoffs on its journal line: totals, then each handoff."""
    return {
        "count": len(lost),
        "blocks": sum(item.blocks for item in lost),
        "block_seconds": sum(item.block_seconds for item in lost),
        "handoffs": [
            {"producer": item.producer, "blocks": item.blocks, "block_seconds": item.block_seconds}
            for item in lost
        ],
    }

"""Seats held back: the last free decode seats of a busy pool, kept for the requests that
need them most (`[tenants_policy] reserved_seats`).

A seat frees only when a request ends, and under a flood every seat is taken the moment
it frees: a light tenant's request, or a more important band's, then waits for the next
one to end, however fair the queue's order. Keeping a few seats back bounds that wait.
The last `seats` free decode seats of a pool go only to a request that is *favoured*:

| the request's tenant, against the tenants holding the pool's seats | favoured |
|---------------------------------------------------------------------|----------|
| a less important band holds seats                                   | yes      |
| a tenant of its band holds more seats per unit of weight than it    | yes      |
| otherwise (it is the heaviest holder, or the pool's only one)       | no       |

The price is those seats, idle while nobody favoured arrives. Pure: the fleet tells it
every seat taken and given back, and asks before a seat is taken.
"""

from __future__ import annotations

from collections.abc import Hashable

from narwhal.fleet.scheduler import Claim


class SeatReserve:
    """Who holds each pool's decode seats, and whether a request may take one of the last."""

    def __init__(self, seats: int = 0) -> None:
        """`seats`: the free decode seats of a pool held back (0: none, and no counting)."""
        self.seats = seats
        # Per pool: per tenant, [seats held, its band, its weight].
        self._holders: dict[Hashable, dict[str, list[float]]] = {}

    def took(self, pool: Hashable, claim: Claim) -> None:
        """A request of `claim`'s tenant took a decode seat of `pool`."""
        holders = self._holders.setdefault(pool, {})
        held = holders.get(claim.tenant)
        if held is None:
            holders[claim.tenant] = [1.0, float(claim.priority), claim.weight]
        else:
            held[0] += 1

    def gave_back(self, pool: Hashable, claim: Claim) -> None:
        """That seat is free again."""
        holders = self._holders.get(pool)
        held = holders.get(claim.tenant) if holders is not None else None
        if holders is None or held is None:
            return
        held[0] -= 1
        if held[0] <= 0:
            del holders[claim.tenant]
            if not holders:
                del self._holders[pool]

    def held(self, pool: Hashable) -> dict[str, int]:
        """Decode seats of `pool` held per tenant."""
        return {tenant: int(held[0]) for tenant, held in self._holders.get(pool, {}).items()}

    def favoured(self, pool: Hashable, claim: Claim) -> bool:
        """Whether a request of `claim` may take one of the seats held back (the table)."""
        holders = self._holders.get(pool, {})
        own = holders.get(claim.tenant)
        mine = (own[0] if own is not None else 0.0) / claim.weight
        for tenant, (count, priority, weight) in holders.items():
            if tenant == claim.tenant:
                continue
            if priority > claim.priority:
                return True
            if priority == claim.priority and count / weight > mine:
                return True
        return False

    def holds_back(self, pool: Hashable, claim: Claim, free: float) -> bool:
        """Whether a request of `claim` must leave the pool's `free` decode seats alone:
        they are all among those held back, and it is not favoured."""
        return free <= self.seats and not self.favoured(pool, claim)

"""The order in which requests waiting for a seat are served, and how long they would wait.

Pure: no event loop, no I/O; the time is passed in as `now` (loop seconds).

**Bands.** A request's `priority` is its band; a lower number is more important (as in
vLLM). Priority is strict: nothing of a band is served while a more important band has
a request waiting. Under overload the least important band gives way first: when the
whole queue is full, a request of a more important band displaces the newest request of
the least important band queued (`push` returns it, as `Queues.admit` does across
pools, and its owner fails it).

**Within a band**, each tenant has its own FIFO queue and the queues take turns by deficit
round robin (Shreedhar and Varghese, 1995). Each turn credits a tenant's deficit with its
quantum (`quantum` times its weight); a tenant is served while its deficit covers the cost
of its head, and each service spends that cost. An unspent deficit is carried to the
tenant's next turn while its queue stays backlogged, and is reset when the queue empties
(an idle tenant saves no credit). Over any interval in which tenants stay backlogged each
receives service in proportion to its weight, within one quantum and one request.

**Work is counted in tokens** (a claim's `cost`: its estimated prompt tokens plus its
`max_tokens`), not in requests: a seat is held for as long as its request's tokens take,
so one tenant's long prompts and long answers must not buy as much of the fleet as
another's short ones at equal weight. Without costs (every cost 1) the same code is fair
in requests.

The quantum defaults to one token. With a small quantum a newly backlogged tenant's
request is served once the other tenants have been served about as many tokens per unit
of weight as it costs: after about one request of each other tenant of equal size and
weight, after about k of them when it costs k times theirs. A large quantum would let
every tenant ahead in the round spend a whole quantum first. Turns in which no head
becomes payable are not stepped through one by one: `_Band.due` finds the first tenant
whose head DRR would serve, and credits every tenant the turns it had before, in one pass
over the band's tenants. This is exactly the order DRR serves in, at any quantum.

A head that is looked at but cannot be served (placement found no seat for it) is not
charged: it is charged when popped. Its owner may also remove it (it left the queue).

**Expected wait.** `Scheduler.ahead(claim)` estimates the work served before a new
request with that claim; `ServiceRate` measures the tokens a pool serves per second while
requests wait; their quotient (`expected_wait`) is the wait the router compares with a
tenant's TTFT objective and a request's deadline, to refuse at once rather than let the
request wait out its timeout.

**Admission.** `Queues` holds one scheduler and one service rate per pool, under one
bound on the whole queue, and decides whether a request is queued, refused at once (its
tenant's queue full: 429; its expected wait too long: 503; the whole queue full: 503,
429 without a tenant), or queued in the place of a less important one or of the band's
tenant holding the most of the queue (which fails with 503).

With one tenant and one band the order is arrival order: the FIFO this replaces.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from narwhal.protocol.errors import Cause, NarwhalError


@dataclass(frozen=True, slots=True)
class Claim:
    """What a waiting request tells the scheduler about itself.

    `priority`: its band, lower served first; `weight`: its tenant's share within the
    band; `cost`: its work in tokens; `max_queued`: its tenant's queue bound (None: only
    the whole queue's); `objective_s`: its tenant's TTFT objective; `deadline`: the loop
    time by which it must be served.
    """

    tenant: str = ""
    priority: int = 0
    weight: float = 1.0
    cost: float = 1.0
    max_queued: int | None = None
    objective_s: float | None = None
    deadline: float | None = None


# The claim of a request without a tenant: one band, one queue, arrival order.
NO_CLAIM = Claim()


T = TypeVar("T", bound=Hashable)


# Float dust in deficit arithmetic must not cost a tenant a whole extra turn.
_SLACK = 1e-9


class _Entry(Generic[T]):
    """One queued item: its cost, its arrival number and its tenant's queue."""

    __slots__ = ("cost", "flow", "item", "seq")

    def __init__(self, item: T, cost: float, seq: int, flow: _Flow[T]) -> None:
        self.item = item
        self.cost = cost
        self.seq = seq
        self.flow = flow


class _Flow(Generic[T]):
    """One tenant's FIFO queue within a band, with its DRR deficit."""

    __slots__ = ("band", "deficit", "entries", "quantum", "tenant", "weight", "work")

    def __init__(self, band: _Band[T], tenant: str, weight: float, quantum: float) -> None:
        self.band = band
        self.tenant = tenant
        self.weight = weight
        self.quantum = quantum * weight
        self.entries: deque[_Entry[T]] = deque()
        self.work = 0.0
        self.deficit = 0.0


class _Band(Generic[T]):
    """The tenants of one priority band, taking turns by deficit round robin.

    `active[0]` is the tenant whose turn it is; `credited` says whether it has had its
    quantum for this turn; `due_head` whether its head is the next item served (cleared
    by whatever changes that head).
    """

    __slots__ = ("active", "count", "credited", "due_head", "flows", "priority", "work")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.flows: dict[str, _Flow[T]] = {}
        self.active: deque[_Flow[T]] = deque()
        self.credited = False
        self.due_head = False
        self.work = 0.0
        self.count = 0

    def due(self) -> _Entry[T]:
        """The entry DRR serves next (the band is not empty); turns are credited, nothing
        is charged."""
        active = self.active
        if self.due_head:
            return active[0].entries[0]
        n = len(active)
        if n == 1:
            # One tenant (as without tenants): its turn lasts until it has enough.
            flow = active[0]
            need = flow.entries[0].cost * (1 - _SLACK) - flow.deficit
            credits = 0 if need <= 0 else math.ceil(need / flow.quantum)
            if not self.credited and credits == 0:
                credits = 1
            if credits:
                flow.deficit += credits * flow.quantum
            self.credited = self.due_head = True
            return flow.entries[0]
        # The first visit, in round order, at which a tenant's deficit covers its head.
        # Visits are numbered i + r * n for the tenant at position i in its (r+1)-th turn.
        best_visit = best_index = best_turns = -1
        for index, flow in enumerate(active):
            need = flow.entries[0].cost * (1 - _SLACK) - flow.deficit
            credits = 0 if need <= 0 else math.ceil(need / flow.quantum)
            # The tenant whose turn it is, already credited, serves in this turn when it
            # needs no credit; every other turn (and any other tenant's) brings one.
            turns = credits if index == 0 and self.credited else max(0, credits - 1)
            visit = index + turns * n
            if best_visit < 0 or visit < best_visit:
                best_visit, best_index, best_turns = visit, index, turns
        # Every tenant is credited for the turns it had up to the winner's: those ahead
        # of it in the round one more than those behind it.
        for index, flow in enumerate(active):
            turns = best_turns + 1 if index <= best_index else best_turns
            if index == 0 and self.credited:
                turns -= 1
            if turns:
                flow.deficit += turns * flow.quantum
        active.rotate(-best_index)
        self.credited = self.due_head = True
        return active[0].entries[0]


class Scheduler(Generic[T]):
    """Items waiting for a seat: strict priority between bands, deficit round robin in
    tokens between tenants within a band. The module's docstring has the rules."""

    def __init__(self, quantum: float = 1.0) -> None:
        """`quantum`: the tokens a tenant of weight 1 is credited per turn."""
        if quantum <= 0:
            raise ValueError(f"quantum must be > 0, got {quantum}")
        self.quantum = quantum
        self._bands: dict[int, _Band[T]] = {}
        # The priorities of the non-empty bands, most important first, and that band.
        self._order: list[int] = []
        self._top: _Band[T] | None = None
        self._where: dict[T, _Entry[T]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: object) -> bool:
        return item in self._where

    def push(self, item: T, claim: Claim = NO_CLAIM) -> None:
        """Queue `item` behind its tenant's items in its band. The bounds are judged
        before, across every pool's scheduler (`Queues.admit`)."""
        priority = claim.priority
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band(priority)
            bisect.insort(self._order, priority)
            self._top = self._bands[self._order[0]]
        flow = band.flows.get(claim.tenant)
        if flow is None:
            if not claim.weight > 0:
                raise ValueError(f"a tenant's weight must be > 0, got {claim.weight}")
            flow = band.flows[claim.tenant] = _Flow(band, claim.tenant, claim.weight, self.quantum)
            band.active.append(flow)
        self._seq += 1
        cost = claim.cost
        entry = _Entry(item, cost, self._seq, flow)
        flow.entries.append(entry)
        flow.work += cost
        band.work += cost
        band.count += 1
        self._where[item] = entry

    def peek(self) -> T | None:
        """The item served next, without serving it (None when empty). Looking is free:
        an item that cannot be served yet stays at the head, uncharged."""
        top = self._top
        if top is None:
            return None
        if top.due_head:
            return top.active[0].entries[0].item
        return top.due().item

    def pop(self) -> T:
        """Serve the head (`peek`'s item): its tenant pays its cost. Raises IndexError
        when empty."""
        top = self._top
        if top is None:
            raise IndexError("pop from an empty scheduler")
        entry = top.active[0].entries[0] if top.due_head else top.due()
        flow = entry.flow
        flow.entries.popleft()
        deficit = flow.deficit - entry.cost
        flow.deficit = deficit if deficit > 0 else 0.0
        top.due_head = False
        self._forget(entry)
        return entry.item

    def heads(self) -> Iterator[T]:
        """Each tenant's first item, most important band first (for a caller that may
        pass over the scheduler's own head: seats held back for others)."""
        for priority in self._order:
            for flow in self._bands[priority].active:
                yield flow.entries[0].item

    def remove(self, item: T) -> bool:
        """Take out an item that will not be served (its waiter left, or it cannot be
        placed); nobody is charged. False when it was not queued."""
        entry = self._where.get(item)
        if entry is None:
            return False
        flow = entry.flow
        if flow.entries[0] is entry:
            flow.entries.popleft()
            if flow.band.active[0] is flow:
                flow.band.due_head = False
        else:
            flow.entries.remove(entry)
        self._forget(entry)
        return True

    def _forget(self, entry: _Entry[T]) -> None:
        """`entry` left its tenant's queue (served or removed): the counts follow, and an
        emptied queue ends its turn and loses its deficit; an emptied band goes."""
        del self._where[entry.item]
        flow = entry.flow
        band = flow.band
        flow.work -= entry.cost
        band.work -= entry.cost
        band.count -= 1
        if not flow.entries:
            del band.flows[flow.tenant]
            if band.active[0] is flow:
                band.active.popleft()
                # The next tenant's turn begins, not yet credited.
                band.credited = band.due_head = False
            else:
                band.active.remove(flow)
        if not band.count:
            del self._bands[band.priority]
            self._order.remove(band.priority)
            self._top = self._bands[self._order[0]] if self._order else None

    def displace(self, priority: int) -> T | None:
        """Take out and return the newest item of the least important band queued, if
        that band is strictly less important than `priority`; else None."""
        if not self._order or self._order[-1] <= priority:
            return None
        band = self._bands[self._order[-1]]
        newest = max((flow.entries[-1] for flow in band.active), key=lambda e: e.seq)
        self.remove(newest.item)
        return newest.item

    def band_work(self, priority: int) -> dict[str, tuple[float, float]]:
        """Per tenant queued in band `priority`: its queued work and its weight."""
        band = self._bands.get(priority)
        if band is None:
            return {}
        return {flow.tenant: (flow.work, flow.weight) for flow in band.active}

    def displace_tenant(self, tenant: str, priority: int) -> T | None:
        """Take out and return `tenant`'s newest item in band `priority`, if it has one."""
        band = self._bands.get(priority)
        flow = band.flows.get(tenant) if band is not None else None
        if flow is None or not flow.entries:
            return None
        newest = flow.entries[-1].item
        self.remove(newest)
        return newest

    def least_important(self) -> int | None:
        """The least important band with an item queued (its priority), if any."""
        return self._order[-1] if self._order else None

    def queued(self, tenant: str) -> int:
        """Items of `tenant` queued."""
        count = 0
        for band in self._bands.values():
            flow = band.flows.get(tenant)
            if flow is not None:
                count += len(flow.entries)
        return count

    def queued_by_tenant(self) -> dict[str, int]:
        """Items queued per tenant (tenants with none are absent)."""
        counts: dict[str, int] = {}
        for band in self._bands.values():
            for tenant, flow in band.flows.items():
                counts[tenant] = counts.get(tenant, 0) + len(flow.entries)
        return counts

    def ahead(self, claim: Claim = NO_CLAIM) -> float:
        """The work (tokens) served before a new item with `claim`, were it pushed now.

        Every item of a more important band; the tenant's own queued items; and for each
        other tenant of its band, what DRR serves that tenant while this tenant is served
        its queue and the new item: that work scaled by the ratio of their weights,
        capped by what the other tenant has queued. (An estimate: it ignores deficits
        carried, the round's position, and later arrivals, which may be more important.)
        """
        work = 0.0
        for priority in self._order:
            if priority >= claim.priority:
                break
            work += self._bands[priority].work
        band = self._bands.get(claim.priority)
        if band is None:
            return work
        own = band.flows.get(claim.tenant)
        own_work = own.work if own is not None else 0.0
        turns = (own_work + claim.cost) / claim.weight
        work += own_work
        for flow in band.active:
            if flow is not own:
                work += min(flow.work, turns * flow.weight)
        return work


class ServiceRate:
    """The tokens one pool serves per second while requests wait for its seats.

    Fed at every request's end (`served` when requests were waiting, `idle` when none
    was): while a backlog lasts, each ended request hands its seat to a waiter, so the
    costs ended over the time between ends are the pool's rate of service. The time
    between an end with nobody waiting and the next end is not counted: the pool had
    free seats then, and would seem slower than it is. Kept over a sliding window of
    `window_s` in `slots` slots; unknown (None) until `min_samples` ends and `min_span_s`
    of service are in the window.
    """

    def __init__(
        self,
        window_s: float = 10.0,
        *,
        slots: int = 10,
        min_samples: int = 3,
        min_span_s: float = 1.0,
    ) -> None:
        if window_s <= 0 or slots < 1:
            raise ValueError("window_s must be > 0 and slots >= 1")
        self.slot_s = window_s / slots
        self.slots = slots
        self.min_samples = min_samples
        self.min_span_s = min_span_s
        # Per slot: [slot number, tokens, seconds, ends], oldest first.
        self._window: deque[list[float]] = deque()
        self._last: float | None = None

    def served(self, cost: float, now: float) -> None:
        """A request of `cost` tokens ended while requests were waiting."""
        last, self._last = self._last, now
        if last is None:
            return  # the first end of a backlog: its interval began with seats free
        slot = now // self.slot_s
        window = self._window
        if window and window[-1][0] == slot:
            current = window[-1]
            current[1] += cost
            current[2] += max(0.0, now - last)
            current[3] += 1
        else:
            window.append([slot, cost, max(0.0, now - last), 1])
            self._expire(slot)

    def idle(self) -> None:
        """A request ended with nobody waiting: the next interval starts afresh."""
        self._last = None

    def _expire(self, slot: float) -> None:
        window = self._window
        while window and window[0][0] <= slot - self.slots:
            window.popleft()

    def rate(self, now: float) -> float | None:
        """Tokens per second over the window; None while too little is known."""
        self._expire(now // self.slot_s)
        tokens = seconds = ends = 0.0
        for _, cost, span, count in self._window:
            tokens += cost
            seconds += span
            ends += count
        if ends < self.min_samples or seconds < self.min_span_s:
            return None
        return tokens / seconds


def expected_wait(ahead: float, rate: float | None) -> float | None:
    """Seconds until `ahead` tokens are served at `rate`; None when the rate is unknown
    (the caller then does not refuse on the wait)."""
    if rate is None or rate <= 0:
        return None
    return ahead / rate


K = TypeVar("K", bound=Hashable)


class Queues(Generic[K, T]):
    """Every pool's scheduler (`pools`, by pool key; an empty one may linger) and service
    rate, and the admission of a request into them."""

    def __init__(self) -> None:
        self.pools: dict[K, Scheduler[T]] = {}
        self.rates: dict[K, ServiceRate] = {}

    def queued(self) -> int:
        """Items queued in every pool."""
        return sum(map(len, self.pools.values()))

    def queued_by_tenant(self) -> dict[str, int]:
        """Items queued per tenant, in every pool."""
        counts: dict[str, int] = {}
        for scheduler in self.pools.values():
            for tenant, count in scheduler.queued_by_tenant().items():
                counts[tenant] = counts.get(tenant, 0) + count
        return counts

    def wait(self, key: K, claim: Claim, now: float) -> float | None:
        """Seconds a new item with `claim` would wait in pool `key`; None when unknown."""
        rate = self.rates.get(key)
        scheduler = self.pools.get(key)
        if rate is None or scheduler is None:
            return None
        return expected_wait(scheduler.ahead(claim), rate.rate(now))

    def admit(
        self, item: T, key: K, claim: Claim, now: float, capacity: int
    ) -> tuple[T, NarwhalError] | None:
        """Queue `item` in pool `key`, or raise the `NarwhalError` that refuses it at once:
        its tenant already has `max_queued` queued in all pools (429
        `rate_limit_exceeded`); its expected wait exceeds its tenant's TTFT objective or
        the time left to its deadline (503); the whole queue holds `capacity` items and
        none of a less important band (429). When one is displaced, returns it with the
        503 its owner fails it with."""
        if claim.max_queued is not None:
            queued = sum(scheduler.queued(claim.tenant) for scheduler in self.pools.values())
            if queued >= claim.max_queued:
                raise NarwhalError(
                    429,
                    f"tenant `{claim.tenant}`'s queue is full ({claim.max_queued} requests "
                    "wait for a seat; its max_queued)",
                    Cause.UNAVAILABLE,
                    retry_after=_retry_after(self.wait(key, claim, now)),
                    code="rate_limit_exceeded",
                    refusal="max_queued",
                )
        if claim.objective_s is not None or claim.deadline is not None:
            late = _late(claim, self.wait(key, claim, now), now)
            if late is not None:
                raise late
        scheduler = self.pools.get(key)
        if scheduler is None:
            scheduler = self.pools[key] = Scheduler()
        shed = None
        if self.queued() >= capacity:
            shed = self._displace(claim, scheduler, now, capacity)
            if shed is None:
                # Fleet overload: 503 for a tenant's request (its own limits are 429s);
                # a request without a tenant keeps the 429 it always had.
                raise NarwhalError(
                    503 if claim.tenant else 429,
                    f"the router's queue is full ({capacity} requests wait for a seat; "
                    "serving.queue_capacity)",
                    Cause.UNAVAILABLE,
                    retry_after=_retry_after(self.wait(key, claim, now)) if claim.tenant else 1,
                    refusal="queue_full",
                )
        scheduler.push(item, claim)
        return shed

    def _displace(
        self, claim: Claim, own: Scheduler[T], now: float, capacity: int
    ) -> tuple[T, NarwhalError] | None:
        """Take out the newest item of the least important band queued in any pool (this
        pool's on a tie), if strictly less important than `claim`'s; else, within the
        claim's own band, the newest item of the tenant most over its share (`_fair`)."""
        best: tuple[K, Scheduler[T]] | None = None
        lowest = claim.priority
        for key, scheduler in self.pools.items():
            least = scheduler.least_important()
            if least is None or least <= claim.priority:
                continue
            if best is None or least > lowest or (least == lowest and scheduler is own):
                best, lowest = (key, scheduler), least
        if best is None:
            return self._fair(claim, own, now, capacity)
        key, scheduler = best
        victim = scheduler.displace(claim.priority)
        assert victim is not None  # its band is less important than the claim's
        return victim, NarwhalError(
            503,
            "shed: a more important request took its place in the queue (the router's "
            f"queue of {capacity} was full; priority band {lowest} gives way to band "
            f"{claim.priority})",
            Cause.UNAVAILABLE,
            # When the rest of its band would be served, were it queued again.
            retry_after=_retry_after(self.wait(key, Claim(priority=lowest), now)),
            refusal="shed",
        )

    def _fair(
        self, claim: Claim, own_pool: Scheduler[T], now: float, capacity: int
    ) -> tuple[T, NarwhalError] | None:
        """In a full queue, a tenant's request takes the place of the newest request of
        the tenant of its band with the most queued work per unit of weight, when that is
        more than its own would be with this request: a flood fills the queue, but never
        shuts a lighter tenant of its band out of it."""
        work: dict[str, list[float]] = {}
        for scheduler in self.pools.values():
            for tenant, (queued, weight) in scheduler.band_work(claim.priority).items():
                held = work.setdefault(tenant, [0.0, weight])
                held[0] += queued
        own = (work.get(claim.tenant, [0.0])[0] + claim.cost) / claim.weight
        heavy = max(
            (t for t in work if t != claim.tenant),
            key=lambda t: work[t][0] / work[t][1],
            default=None,
        )
        if heavy is None or work[heavy][0] / work[heavy][1] <= own:
            return None
        # From the pool where that tenant waits with the most work (this one's on a tie).
        key, scheduler = max(
            self.pools.items(),
            key=lambda pool: (
                pool[1].band_work(claim.priority).get(heavy, (0.0, 1.0))[0],
                pool[1] is own_pool,
            ),
        )
        victim = scheduler.displace_tenant(heavy, claim.priority)
        assert victim is not None  # the tenant has work queued in that pool
        return victim, NarwhalError(
            503,
            f"shed: tenant `{heavy}` held the most of the router's full queue ({capacity} "
            f"requests; serving.queue_capacity) for its weight, and a request of a tenant "
            "with less took this one's place",
            Cause.UNAVAILABLE,
            retry_after=_retry_after(
                self.wait(key, Claim(tenant=heavy, priority=claim.priority), now)
            ),
            refusal="shed",
        )

    def served(self, key: K, cost: float, now: float) -> None:
        """An item of pool `key` ended while items waited there: its cost counts in the
        pool's service rate."""
        rate = self.rates.get(key)
        if rate is None:
            rate = self.rates[key] = ServiceRate()
        rate.served(cost, now)

    def idle(self, key: K) -> None:
        """An item of pool `key` ended with none waiting there."""
        rate = self.rates.get(key)
        if rate is not None:
            rate.idle()


def _retry_after(wait: float | None) -> int:
    """Whole seconds, at least 1 (1 when the wait is unknown)."""
    return 1 if wait is None else max(1, math.ceil(wait))


def _late(claim: Claim, wait: float | None, now: float) -> NarwhalError | None:
    """503 when `wait` exceeds the claim's TTFT objective or the time left before its
    deadline, naming the tighter of the two; None when within both or unknown."""
    if wait is None:
        return None
    bounds: list[tuple[float, str]] = []
    if claim.objective_s is not None:
        whose = f"tenant `{claim.tenant}`'s" if claim.tenant else "its tenant's"
        bounds.append((claim.objective_s, f"{whose} ttft_objective_s {claim.objective_s:g} s"))
    if claim.deadline is not None:
        left = claim.deadline - now
        bounds.append((left, f"the {max(0.0, left):.1f} s left before its deadline"))
    bound, what = min(bounds)
    if wait <= bound:
        return None
    return NarwhalError(
        503,
        f"expected queue wait {wait:.1f} s exceeds {what}",
        Cause.UNAVAILABLE,
        retry_after=_retry_after(wait),
        refusal="overload",
    )

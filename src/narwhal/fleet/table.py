"""The engines the router knows, their phase seats, placement, and the wait for a seat.

The request path asks `Fleet.reserve()` for a producer and a consumer and gets back a
`Reservation` holding one prefill seat and one decode seat, each released exactly once.
When no pair of seats is free the request waits in its pool's queue (`fleet.scheduler`:
strict priority between bands, fair shares between tenants, arrival order without them),
or is refused at once when its expected wait exceeds its tenant's TTFT objective or its
own deadline, or when its tenant's queue or the whole queue is full (a more important
request takes a less important one's place rather than be refused).

Placement degrades rather than refuse while any engine accepts connections:

| admitted engines                 | placement                                             |
|----------------------------------|-------------------------------------------------------|
| a producer and a consumer        | ordinary: a crossed handoff (same engine only when no |
|                                  |   distinct consumer is admitted)                      |
| no producer (or only ones this   | aggregate fallback: a consumer serves the whole       |
|   request already failed on)     |   request alone, no prefill leg, no descriptor        |
| no consumer                      | panic: decode on a non-admitted decode engine that    |
|                                  |   does not refuse connections and met its contract    |
| none of those                    | 503 naming why, with Retry-After                      |

An operator may drain an engine (see `operations`): it gets no new work of any kind, not
even panic placement or a readmission probe's partner leg, while the requests holding its
seats finish there; its state is `draining` until its last seat is released (an event,
`drained`), then `drained`. Engines may also be added, changed and removed at runtime.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from narwhal.config.engine_spec import EngineSpec
from narwhal.config.models import LoraConfig
from narwhal.config.placement import PlacementConfig
from narwhal.fleet.engine import Engine as Engine
from narwhal.fleet.engine import Phase as Phase
from narwhal.fleet.events import EngineEvent as EngineEvent
from narwhal.fleet.events import EventListener as EventListener
from narwhal.fleet.lifecycle import EngineState as EngineState
from narwhal.fleet.lifecycle import Event
from narwhal.fleet.models import Catalog, Target
from narwhal.fleet.placement import Placer, PromptKey
from narwhal.fleet.reserve import SeatReserve
from narwhal.fleet.scheduler import NO_CLAIM, Claim, Queues, Scheduler
from narwhal.fleet.seat_share import WHOLE, SeatShare
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.runtime.clock import clock

NOT_YET_PROBED = "added at runtime: waiting for its first probe"


@dataclass(eq=False, slots=True)
class Reservation:
    """A request's seats: one prefill seat on the producer, one decode seat on the consumer.

    Its holder keeps it in `async with`: leaving the block releases whatever is still
    held. The prefill seat may go sooner (`release_prefill`, once the prefill answered).
    Each seat is released exactly once; later calls are no-ops.
    """

    fleet: Fleet
    producer: Engine
    consumer: Engine
    prefill_held: bool = True
    decode_held: bool = True
    # Aggregate fallback: the consumer serves the whole request; `producer` is the consumer
    # and no prefill seat is held.
    fallback: bool = False
    # The consumer was not admitted: panic placement.
    panic: bool = False
    # The prompt's prefix placement expects the producer to hold (`fleet.placement`).
    prefix_matched: int = 0
    # The pool and adapter it was placed for; the engines that must load the adapter
    # before its legs are sent (`Fleet.prepare` loads them).
    target: Target | None = None
    loads: tuple[Engine, ...] = ()
    # Its work in tokens (`Claim.cost`), counted in its pool's service rate at its end.
    cost: float = 1.0
    # Its tenant's claim, while seats are held back for some (`fleet.reserve`).
    claim: Claim | None = None

    @property
    def crossed(self) -> bool:
        return self.producer is not self.consumer

    def release_prefill(self) -> None:
        if self.prefill_held:
            self.prefill_held = False
            self.producer.prefill_seats -= 1
            if self.target is not None and self.target.adapter is not None:
                self.producer.use_adapter(self.target.adapter, -1)
            self.fleet.seat_freed()

    def release_decode(self) -> None:
        if self.decode_held:
            self.decode_held = False
            self.consumer.decode_seats -= 1
            if self.target is not None and self.target.adapter is not None:
                self.consumer.use_adapter(self.target.adapter, -1)
            self.fleet.note_served(self)
            self.fleet.seat_freed()

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


@dataclass(eq=False, slots=True)
class _Waiter:
    avoid: frozenset[str]
    key: PromptKey | None
    target: Target | None
    claim: Claim
    future: asyncio.Future[Reservation]


# Loads a reservation's adapters on its engines (`fleet.adapters`); False when one failed
# (that engine is then passed over for that adapter, and placement is tried again).
Prepare = Callable[[Reservation], Awaitable[bool]]


class Fleet:
    """Every configured engine, placement over the admitted ones, and the seat queue."""

    def __init__(
        self,
        specs: Iterable[EngineSpec],
        *,
        queue_capacity: int = 1024,
        queue_timeout_s: float = 30.0,
        rng: random.Random | None = None,
        share: SeatShare = WHOLE,
        placement: PlacementConfig | None = None,
        catalog: Catalog | None = None,
        lora: LoraConfig | None = None,
        reserved_seats: int = 0,
    ) -> None:
        """`share`: this process's part of every engine's seat limits; `placement`: how
        an engine is chosen among those with a seat (`fleet.placement`); `catalog`: the
        names clients use for the pools (one pool, of the default model, without it);
        `lora`: whether and how adapters are loaded on demand; `reserved_seats`: a busy
        pool's last free decode seats, held back for favoured requests (`fleet.reserve`)."""
        self.share = share
        self.catalog = catalog or Catalog.single("")
        self.lora = lora or LoraConfig()
        self.engines = [self._engine(spec) for spec in specs]
        self.by_id = {engine.id: engine for engine in self.engines}
        self.catalog.learn(self.engines)
        self.queue_capacity = queue_capacity
        self.queue_timeout_s = queue_timeout_s
        # One queue per pool and adapter: a head that waits blocks only its own pool.
        self._queues: Queues[Target | None, _Waiter] = Queues()
        self._pools = self._queues.pools
        self.seat_reserve = SeatReserve(reserved_seats)
        self.prepare: Prepare | None = None
        self._rng = rng or random.Random()
        self.placer = Placer(placement or PlacementConfig(), self._rng)
        self._waking = False
        self.listeners: list[EventListener] = []
        # Draining engines whose `drained` event is still to come.
        self._draining: set[Engine] = set()

    def emit(self, event: EngineEvent) -> None:
        for listener in self.listeners:
            listener(event)

    @property
    def queued(self) -> int:
        return self._queues.queued()

    def queued_in(self, model: str) -> int:
        """Requests waiting for a seat in one pool (with several pools)."""
        return sum(
            len(queue)
            for key, queue in self._pools.items()
            if key is not None and key.base == model
        )

    def queued_by_tenant(self) -> dict[str, int]:
        """Requests waiting for a seat, per tenant (`""`: those without one)."""
        return self._queues.queued_by_tenant()

    def models(self) -> list[str]:
        """The pools: every base model an engine serves, in the engines' order."""
        return list(dict.fromkeys(e.model for e in self.engines))

    def pool(self, model: str) -> list[Engine]:
        """The engines of one base model."""
        return [e for e in self.engines if e.model == model]

    def models_changed(self) -> None:
        """An engine's model or adapters changed: the names follow, and waiters may now
        be placed (or learn they cannot)."""
        self.catalog.learn(self.engines)
        self.seat_freed()

    def admitted(
        self, phase: Phase, now: float | None = None, among: Iterable[Engine] | None = None
    ) -> list[Engine]:
        """Admitted engines of `phase`, of the whole fleet or `among` some."""
        now = _now() if now is None else now
        return [
            e
            for e in (self.engines if among is None else among)
            if e.serves(phase) and e.state(now) is EngineState.ADMITTED
        ]

    def can_serve(self, model: str | None = None) -> bool:
        """Whether placement would find a consumer (admitted, or by panic), in one pool or
        in any."""
        now = _now()
        pools = [model] if model is not None else self.models()
        for name in pools:
            members = self.pool(name) if self.catalog.several else self.engines
            if self.admitted(Phase.DECODE, now, members) or self.panic_candidates(
                Phase.DECODE, now, members
            ):
                return True
        return False

    def degraded(self) -> bool:
        """Whether some pool has a phase with no admitted engine (fallback or panic
        placement)."""
        now = _now()
        for name in self.models() if self.catalog.several else [None]:
            members = self.engines if name is None else self.pool(name)
            if not (
                self.admitted(Phase.PREFILL, now, members)
                and self.admitted(Phase.DECODE, now, members)
            ):
                return True
        return False

    def quarantine(self, engine: Engine, seconds: float, reason: str) -> None:
        """Out of placement for `seconds` (a longer quarantine already running stands)."""
        now = _now()
        engine.quarantines += 1
        engine.lifecycle.apply(
            Event.QUARANTINE,
            self.emit,
            f"{seconds:g} s after {reason}",
            now=now,
            until=now + seconds,
        )

    # Runtime changes (the checks and the journal's wording live in `operations`) -----

    def add(self, spec: EngineSpec, detail: str, *, source: str | None = None) -> Engine:
        """A new engine, out of placement until readmission has judged it as it judges a
        restarted one (health, the pinned contract, a real transfer with a partner): an
        operator's typo in a url or a model must not cost requests. `detail`: its `added`
        event's; `source`: see `Engine.source`."""
        engine = self._engine(spec, new=True)
        engine.ejection_reason, engine.source = NOT_YET_PROBED, source
        self.engines.append(engine)
        self.by_id[engine.id] = engine
        self.catalog.learn(self.engines)
        engine.lifecycle.apply(Event.JOIN, self.emit, detail)
        return engine

    def _engine(self, spec: EngineSpec, *, new: bool = False) -> Engine:
        engine = Engine(spec, pinned=spec.pin, acting=spec.start_as, share=self.share, new=new)
        engine.model = spec.model or self.catalog.default
        return engine

    def remove(self, engine: Engine, why: str) -> None:
        """Forget a drained engine; the caller made sure no request holds its seats."""
        self.engines.remove(engine)
        del self.by_id[engine.id]
        self.placer.index.clear(engine.id)
        self._draining.discard(engine)
        self.catalog.learn(self.engines)
        engine.lifecycle.apply(Event.REMOVE, self.emit, why)

    def drain(self, engine: Engine, why: str) -> None:
        """No new work for the engine; `drained` is emitted once its seats are free."""
        engine.lifecycle.apply(Event.DRAIN, self.emit, why)
        self._draining.add(engine)
        # Waiters that only this engine could serve learn so now, not at their timeout.
        self.seat_freed()

    def undrain(self, engine: Engine, why: str) -> None:
        """Back into placement (unless it is also ejected); waiters may take its seats."""
        engine.remove_when_drained = False
        self._draining.discard(engine)
        engine.lifecycle.apply(Event.UNDRAIN, self.emit, why)
        self.seat_freed()

    def _note_drained(self) -> None:
        for engine in [e for e in self._draining if not e.busy()]:
            self._draining.discard(engine)
            engine.lifecycle.apply(Event.SETTLE, self.emit, "its last request finished")

    # Placement ---------------------------------------------------------------------

    def try_reserve(
        self,
        avoid: frozenset[str] = frozenset(),
        key: PromptKey | None = None,
        target: Target | None = None,
    ) -> Reservation | None:
        """Seats on a producer and a consumer now, or None if no pair is free.

        Only the engines of the request's pool (`target`) are candidates; for an adapter,
        those that hold it, else (with `lora.load_on_demand`) those that may load it. The
        placement policy chooses among engines with a seat (power of two choices over
        the load estimate without a prompt `key`); engines in `avoid` (they failed this
        request before) only when nothing else has a seat. The same engine serves both
        phases only when no distinct admitted consumer exists. Without an admitted
        producer, aggregate fallback; without an admitted consumer, panic placement (the
        table above); raises 503 only when neither can be had.
        """
        now = _now()
        members = self._members(target, now)
        consumers = self.admitted(Phase.DECODE, now, members)
        panic = not consumers
        if panic:
            consumers = self.panic_candidates(Phase.DECODE, now, members)
            if not consumers:
                raise self._unservable(Phase.DECODE, members, target)
        producers = self.admitted(Phase.PREFILL, now, members)
        if not [p for p in producers if p.id not in avoid]:
            return self._fallback(consumers, avoid, panic, key, target)
        free = [e for e in producers if e.has_seat(Phase.PREFILL)]
        producer, matched = self._pick(Phase.PREFILL, free, avoid, key, target)
        if producer is None:
            return None
        distinct = [c for c in consumers if c is not producer]
        pool = distinct or consumers
        consumer, _ = self._pick(
            Phase.DECODE, [c for c in pool if c.has_seat(Phase.DECODE)], avoid, key, target
        )
        if consumer is None:
            return None
        producer.prefill_seats += 1
        consumer.decode_seats += 1
        if panic:
            consumer.panics += 1
        self.placer.placed(Phase.PREFILL, producer.id, key)
        self.placer.placed(Phase.DECODE, consumer.id, key)
        reservation = Reservation(
            self, producer, consumer, panic=panic, prefix_matched=matched, target=target
        )
        if target is not None and target.adapter is not None:
            self._hold_adapter(reservation, target.adapter)
        return reservation

    def _members(self, target: Target | None, now: float) -> list[Engine]:
        """The engines a request for `target` may be placed on: its pool's, and for an
        adapter those holding it or, on demand, able to load it."""
        if target is None or not self.catalog.several:
            return self.engines
        members = [e for e in self.engines if e.model == target.base]
        adapter = target.adapter
        if not members:
            raise NarwhalError(
                503,
                f"no engine serves model `{target.base}` now",
                Cause.UNAVAILABLE,
                retry_after=1,
            )
        if adapter is None:
            return members
        holders = [e for e in members if adapter in e.adapters]
        loadable = self.lora.load_on_demand and self.lora.adapter(adapter) is not None
        if loadable:
            holders += [
                e for e in members if adapter not in e.adapters and self._may_load(e, adapter, now)
            ]
        if not holders:
            raise NarwhalError(
                503,
                f"no engine of model `{target.base}` holds the adapter `{adapter}` now"
                + (" or may load it" if loadable else ""),
                Cause.UNAVAILABLE,
                retry_after=1,
            )
        return holders

    def _may_load(self, engine: Engine, adapter: str, now: float) -> bool:
        """Whether `adapter` may be loaded on `engine`: no recent failure of that load,
        and room under `lora.max_adapters_per_engine` (or one to evict)."""
        if engine.adapter_failed.get(adapter, 0.0) > now:
            return False
        bound = self.lora.max_adapters_per_engine
        return bound is None or len(engine.adapters) < bound or engine.evictable() is not None

    def _hold_adapter(self, reservation: Reservation, adapter: str) -> None:
        """The reservation's engines use `adapter`; those that lack it must load it."""
        engines = (
            [reservation.consumer]
            if reservation.fallback
            else [reservation.producer, reservation.consumer]
        )
        for engine in engines:
            engine.use_adapter(adapter, +1)
        reservation.loads = tuple(dict.fromkeys(e for e in engines if not e.holds(adapter)))

    def _fallback(
        self,
        consumers: list[Engine],
        avoid: frozenset[str],
        panic: bool,
        key: PromptKey | None,
        target: Target | None,
    ) -> Reservation | None:
        free = [c for c in consumers if c.has_seat(Phase.DECODE)]
        consumer, matched = self._pick(Phase.DECODE, free, avoid, key, target)
        if consumer is None:
            return None
        consumer.decode_seats += 1
        if panic:
            consumer.panics += 1
        self.placer.placed(Phase.DECODE, consumer.id, key)
        reservation = Reservation(
            self,
            consumer,
            consumer,
            prefill_held=False,
            fallback=True,
            panic=panic,
            prefix_matched=matched,
            target=target,
        )
        if target is not None and target.adapter is not None:
            self._hold_adapter(reservation, target.adapter)
        return reservation

    def panic_candidates(
        self, phase: Phase, now: float, among: Iterable[Engine] | None = None
    ) -> list[Engine]:
        """Engines of `phase` that are out of placement but may still serve: not refusing
        connections, not breaking the pinned contract."""
        return [
            e
            for e in (self.engines if among is None else among)
            if e.serves(phase)
            and e.state(now) is not EngineState.ADMITTED
            and not e.draining
            and not e.refusing
            and not e.mismatched
        ]

    def _unservable(
        self, phase: Phase, members: list[Engine], target: Target | None
    ) -> NarwhalError:
        members = [e for e in members if e.serves(phase)]
        refusing = sum(e.refusing for e in members)
        mismatched = sum(e.mismatched for e in members)
        drained = sum(e.draining for e in members)
        why = [f"{refusing} refuse connections"] if refusing else []
        why += [f"{mismatched} break the engine contract"] if mismatched else []
        why += [f"{drained} drained by an operator"] if drained else []
        engines = (
            f"engine of model `{target.base}`"
            if target is not None and self.catalog.several
            else "engine"
        )
        return NarwhalError(
            503,
            f"no {engines} can {phase.value}: none of the {len(members)} is admitted"
            + (f" ({', '.join(why)})" if why else ""),
            Cause.UNAVAILABLE,
            retry_after=1,
        )

    def _pick(
        self,
        phase: Phase,
        candidates: list[Engine],
        avoid: frozenset[str],
        key: PromptKey | None,
        target: Target | None,
    ) -> tuple[Engine | None, int]:
        preferred = [e for e in candidates if e.id not in avoid] or candidates
        if target is not None and target.adapter is not None:
            # Engines that hold the adapter first: one that must load it only when none
            # of those has a seat.
            preferred = [e for e in preferred if target.adapter in e.adapters] or preferred
        return self.placer.choose(phase.value, preferred, key)

    # Waiting for a seat ------------------------------------------------------------

    async def reserve(
        self,
        avoid: frozenset[str] = frozenset(),
        key: PromptKey | None = None,
        target: Target | None = None,
        claim: Claim | None = None,
    ) -> Reservation:
        """A reservation, waiting in the pool's queue for up to `queue_timeout_s`, with
        the adapter `target` names loaded on its engines.

        `claim`: the request's tenant, band, weight, cost and bounds (`fleet.scheduler`);
        without one the request waits in arrival order with those that have none. It is
        refused at once (`Queues.admit`) rather than queued when it would wait too long or
        its tenant's queue is full. The request's own deadline (an enclosing timeout) may
        end the wait sooner; a waiter that leaves for any reason never keeps a seat. A
        failed load passes that engine over for the adapter and places the request again.
        """
        for _ in range(len(self.engines) + 1):
            reservation = await self._seats(avoid, key, target, claim)
            if not reservation.loads or self.prepare is None:
                return reservation
            try:
                loaded = await self.prepare(reservation)
            except BaseException:
                reservation.release()
                raise
            if loaded:
                reservation.loads = ()
                return reservation
            reservation.release()
        raise NarwhalError(
            503,
            f"the adapter `{target.adapter if target else ''}` could not be loaded on any engine",
            Cause.UNAVAILABLE,
            retry_after=1,
        )

    async def _seats(
        self,
        avoid: frozenset[str],
        key: PromptKey | None,
        target: Target | None,
        claim: Claim | None,
    ) -> Reservation:
        queue_key = target if self.catalog.several else None
        scheduler = self._pools.get(queue_key)
        claimed = claim or NO_CLAIM
        # Nobody waits for this pool: no scheduler work, as without tenants.
        if not scheduler and not self._held_back(queue_key, claimed, target):
            reservation = self.try_reserve(avoid, key, target)
            if reservation is not None:
                self._granted(reservation, queue_key, claimed)
                return reservation
        waiter = _Waiter(avoid, key, target, claimed, asyncio.get_running_loop().create_future())
        shed = self._queues.admit(waiter, queue_key, claimed, _now(), self.queue_capacity)
        if shed is not None:
            victim, error = shed
            if not victim.future.done():
                victim.future.set_exception(error)
        if self.seat_reserve.seats:
            # A favoured request may take a held-back seat now, past those queued.
            self.seat_freed()
        try:
            async with clock().timeout(self.queue_timeout_s):
                return await waiter.future
        except TimeoutError:
            self._abandon(waiter)
            raise NarwhalError(
                503,
                f"no seat became free within {self.queue_timeout_s:g} s (serving.queue_timeout_s)",
                Cause.UNAVAILABLE,
                retry_after=max(1, math.ceil(self.queue_timeout_s / 10)),
            ) from None
        except BaseException:
            self._abandon(waiter)
            raise

    def _granted(self, reservation: Reservation, queue_key: Target | None, claim: Claim) -> None:
        reservation.cost = claim.cost
        if self.seat_reserve.seats:
            reservation.claim = claim
            self.seat_reserve.took(queue_key, claim)

    def _held_back(self, queue_key: Target | None, claim: Claim, target: Target | None) -> bool:
        """Whether the pool's free decode seats are all held back from this request."""
        return bool(self.seat_reserve.seats) and self.seat_reserve.holds_back(
            queue_key, claim, self._free_decode(target)
        )

    def _free_decode(self, target: Target | None) -> float:
        """Free decode seats on the pool's admitted engines (infinite when one has no
        limit, or when the pool cannot be placed at all: placement then says why)."""
        now = _now()
        try:
            members = self._members(target, now)
        except NarwhalError:
            return math.inf
        free = 0
        for engine in self.admitted(Phase.DECODE, now, members):
            limit = engine.seat_limit(Phase.DECODE)
            if limit is None:
                return math.inf
            free += max(0, limit - engine.decode_seats)
        return free

    def note_served(self, reservation: Reservation) -> None:
        """A reservation's decode seat is released: while requests wait for its pool,
        its cost counts in the pool's service rate."""
        queue_key = reservation.target if self.catalog.several else None
        if reservation.claim is not None:
            self.seat_reserve.gave_back(queue_key, reservation.claim)
        if self._pools.get(queue_key):
            self._queues.served(queue_key, reservation.cost, _now())
        else:
            self._queues.idle(queue_key)

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter leaves: seats granted to it in the meantime go back."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().release()
            return
        future.cancel()
        scheduler = self._pools.get(waiter.target if self.catalog.several else None)
        if scheduler is not None and scheduler.remove(waiter):
            self.seat_freed()

    def seat_freed(self) -> None:
        """Grant seats to waiters in each pool's scheduler order; a pool's head blocks
        those behind it, not another pool's."""
        if self._draining:
            self._note_drained()
        if self._waking:
            return
        self._waking = True
        try:
            for queue_key, scheduler in list(self._pools.items()):
                self._wake(scheduler, queue_key)
                if not scheduler:
                    del self._pools[queue_key]
        finally:
            self._waking = False

    def _passing(
        self, scheduler: Scheduler[_Waiter], queue_key: Target | None, head: _Waiter
    ) -> _Waiter | None:
        """The waiter to place now: the head, unless the seats left are held back from
        it; then the first favoured waiter, if any (`fleet.reserve`)."""
        if not self._held_back(queue_key, head.claim, head.target):
            return head
        return next(
            (
                w
                for w in scheduler.heads()
                if not w.future.done() and not self.seat_reserve.holds_back(queue_key, w.claim, 0)
            ),
            None,
        )

    def _wake(self, scheduler: Scheduler[_Waiter], queue_key: Target | None) -> None:
        while (head := scheduler.peek()) is not None:
            if head.future.done():
                scheduler.remove(head)
                continue
            chosen = self._passing(scheduler, queue_key, head)
            if chosen is None:
                return
            try:
                reservation = self.try_reserve(chosen.avoid, chosen.key, chosen.target)
            except NarwhalError as error:
                scheduler.remove(chosen)
                chosen.future.set_exception(error)
                continue
            if reservation is None:
                return
            if chosen is head:
                scheduler.pop()
            else:
                scheduler.remove(chosen)
            self._granted(reservation, queue_key, chosen.claim)
            chosen.future.set_result(reservation)


def _now() -> float:
    return asyncio.get_running_loop().time()

"""The engines the router knows, their phase seats, placement, and the wait for a seat.

The request path asks `Fleet.reserve()` for a producer and a consumer and gets back a
`Reservation` holding one prefill seat and one decode seat, each released exactly once.
When no pair of seats is free the request waits in a bounded FIFO queue.

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
from collections import deque
from collections.abc import Iterable
from dataclasses import InitVar, dataclass, field
from enum import StrEnum

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.placement import PlacementConfig
from narwhal.engines.scrape import EngineReport
from narwhal.fleet.events import EngineEvent as EngineEvent
from narwhal.fleet.events import EventListener as EventListener
from narwhal.fleet.lifecycle import EngineState as EngineState
from narwhal.fleet.lifecycle import Event, Lifecycle
from narwhal.fleet.placement import Placer, PromptKey
from narwhal.fleet.seat_share import WHOLE, SeatShare
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.runtime.clock import clock

NOT_YET_PROBED = "added at runtime: waiting for its first probe"


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False, slots=True)
class Engine:
    """One engine as the router sees it: its spec, its seats in use and its standing (its
    `lifecycle`, which alone changes it)."""

    spec: EngineSpec
    prefill_seats: int = 0
    decode_seats: int = 0
    # Queue depth the engine itself reports (`vllm:num_requests_waiting`), when polled.
    reported_waiting: float = 0.0
    # Requests on it that other routers (or workers) sent, by its last report.
    others: float = 0.0
    # This process's part of its seat limits (see `seat_share`).
    share: SeatShare = WHOLE
    # The engine's last `/metrics` reading, and its prompt tokens by source since the first
    # (see `engine_reports`); the crossed decodes the router sent it, to compare.
    report: EngineReport | None = None
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    crossed_decodes: int = 0
    silent_recomputes: int = 0
    # Leg failures by cause (`Cause` values), since start.
    failures: dict[str, int] = field(default_factory=dict)
    # Breaker: consecutive stream failures, and why the engine was last ejected.
    streak: int = 0
    ejection_reason: str | None = None
    # After a crossed decode failure: the producer whose handoff the probe should reuse.
    probe_producer: str | None = None
    ejections: int = 0
    quarantines: int = 0
    # Its last connection attempt was refused (or broke); cleared by any answer.
    refusing: bool = False
    # Readmission found it breaks the pinned contract: never placed on, even in panic.
    mismatched: bool = False
    # The breaker would have ejected it but for `max_ejected_fraction` (this streak; times).
    spared: bool = False
    spares: int = 0
    # Requests placed on it while it was not admitted (panic placement).
    panics: int = 0
    # Readmission probes by result: "success", "failure", "inconclusive".
    probes: dict[str, int] = field(default_factory=dict)
    # Delete it once drained (a reload dropped it from the config file).
    remove_when_drained: bool = False
    # The role controller never moves it: its role is the operator's to choose.
    pinned: bool = False
    # For an engine of role `both`: the one phase it serves now (its `start_as`, or where
    # the role controller moved it); None serves both.
    acting: Role | None = None
    # Event-loop time of its last role change by the controller; None: since start.
    role_since: float | None = None
    # Where it came from: None for the config file and the admin API, "kubernetes" for
    # discovery. Placement never reads it; reloads and discovery each keep to their own.
    source: str | None = None
    # Added at runtime: its lifecycle starts `new` (see `Fleet.add`).
    new: InitVar[bool] = False
    lifecycle: Lifecycle = field(init=False)

    def __post_init__(self, new: bool) -> None:
        self.lifecycle = Lifecycle(self.spec.id, new=new)

    @property
    def ejected(self) -> bool:
        return self.lifecycle.ejected

    @property
    def held(self) -> bool:
        return self.lifecycle.held

    @property
    def draining(self) -> bool:
        """An operator (or a source) drained it; cleared only by an undrain."""
        return self.lifecycle.draining

    @property
    def quarantined_until(self) -> float:
        return self.lifecycle.quarantined_until

    @property
    def role(self) -> Role:
        """The role placement uses: the phase it acts in, within what its spec allows."""
        return (
            self.acting
            if self.acting is not None and self.spec.role is Role.BOTH
            else self.spec.role
        )

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    def state(self, now: float) -> EngineState:
        return self.lifecycle.state(now, self.busy())

    def serves(self, phase: Phase) -> bool:
        role = self.role
        return role.can_prefill if phase is Phase.PREFILL else role.can_decode

    def busy(self) -> bool:
        """Whether any request holds one of its seats."""
        return bool(self.prefill_seats or self.decode_seats)

    def seat_limit(self, phase: Phase) -> int | None:
        """This process's seats of the phase (its share of the engine's limit); None:
        unlimited."""
        limit = (
            self.spec.max_prefill_seats if phase is Phase.PREFILL else self.spec.max_decode_seats
        )
        return self.share.of(limit)

    def has_seat(self, phase: Phase) -> bool:
        used = self.prefill_seats if phase is Phase.PREFILL else self.decode_seats
        limit = self.seat_limit(phase)
        return limit is None or used < limit

    def load(self) -> float:
        """Fraction of this process's seats in use (a raw count where unlimited), plus the
        requests others have on the engine as a fraction of its whole capacity."""
        capacity = sum(
            limit
            for phase, limit in (
                (Phase.PREFILL, self.spec.max_prefill_seats),
                (Phase.DECODE, self.spec.max_decode_seats),
            )
            if self.serves(phase)
        )
        return (
            _fraction(self.prefill_seats, self.seat_limit(Phase.PREFILL) or 0)
            + _fraction(self.decode_seats, self.seat_limit(Phase.DECODE) or 0)
            + _fraction(self.others, capacity)
        )


def _fraction(used: float, limit: int) -> float:
    return used / limit if limit else float(used)


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

    @property
    def crossed(self) -> bool:
        return self.producer is not self.consumer

    def release_prefill(self) -> None:
        if self.prefill_held:
            self.prefill_held = False
            self.producer.prefill_seats -= 1
            self.fleet.seat_freed()

    def release_decode(self) -> None:
        if self.decode_held:
            self.decode_held = False
            self.consumer.decode_seats -= 1
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
    future: asyncio.Future[Reservation]


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
    ) -> None:
        """`share`: this process's part of every engine's seat limits; `placement`: how
        an engine is chosen among those with a seat (`fleet.placement`)."""
        self.share = share
        self.engines = [_engine(spec, share) for spec in specs]
        self.by_id = {engine.id: engine for engine in self.engines}
        self.queue_capacity = queue_capacity
        self.queue_timeout_s = queue_timeout_s
        self._queue: deque[_Waiter] = deque()
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
        return len(self._queue)

    def admitted(self, phase: Phase, now: float | None = None) -> list[Engine]:
        now = _now() if now is None else now
        return [e for e in self.engines if e.serves(phase) and e.state(now) is EngineState.ADMITTED]

    def can_serve(self) -> bool:
        """Whether placement would find a consumer (admitted, or by panic)."""
        now = _now()
        return bool(self.admitted(Phase.DECODE, now) or self.panic_candidates(Phase.DECODE, now))

    def degraded(self) -> bool:
        """Whether some phase has no admitted engine (fallback or panic placement)."""
        now = _now()
        return not (self.admitted(Phase.PREFILL, now) and self.admitted(Phase.DECODE, now))

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
        engine = _engine(spec, self.share, new=True)
        engine.ejection_reason, engine.source = NOT_YET_PROBED, source
        self.engines.append(engine)
        self.by_id[engine.id] = engine
        engine.lifecycle.apply(Event.JOIN, self.emit, detail)
        return engine

    def remove(self, engine: Engine, why: str) -> None:
        """Forget a drained engine; the caller made sure no request holds its seats."""
        self.engines.remove(engine)
        del self.by_id[engine.id]
        self.placer.index.clear(engine.id)
        self._draining.discard(engine)
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
        self, avoid: frozenset[str] = frozenset(), key: PromptKey | None = None
    ) -> Reservation | None:
        """Seats on a producer and a consumer now, or None if no pair is free.

        The placement policy chooses among engines with a seat (power of two choices over
        the load estimate without a prompt `key`); engines in `avoid` (they failed this
        request before) only when nothing else has a seat. The same engine serves both
        phases only when no distinct admitted consumer exists. Without an admitted
        producer, aggregate fallback; without an admitted consumer, panic placement (the
        table above); raises 503 only when neither can be had.
        """
        now = _now()
        consumers = self.admitted(Phase.DECODE, now)
        panic = not consumers
        if panic:
            consumers = self.panic_candidates(Phase.DECODE, now)
            if not consumers:
                raise self._unservable(Phase.DECODE)
        producers = self.admitted(Phase.PREFILL, now)
        if not [p for p in producers if p.id not in avoid]:
            return self._fallback(consumers, avoid, panic, key)
        free = [e for e in producers if e.has_seat(Phase.PREFILL)]
        producer, matched = self._pick(Phase.PREFILL, free, avoid, key)
        if producer is None:
            return None
        distinct = [c for c in consumers if c is not producer]
        pool = distinct or consumers
        consumer, _ = self._pick(
            Phase.DECODE, [c for c in pool if c.has_seat(Phase.DECODE)], avoid, key
        )
        if consumer is None:
            return None
        producer.prefill_seats += 1
        consumer.decode_seats += 1
        if panic:
            consumer.panics += 1
        self.placer.placed(Phase.PREFILL, producer.id, key)
        self.placer.placed(Phase.DECODE, consumer.id, key)
        return Reservation(self, producer, consumer, panic=panic, prefix_matched=matched)

    def _fallback(
        self, consumers: list[Engine], avoid: frozenset[str], panic: bool, key: PromptKey | None
    ) -> Reservation | None:
        free = [c for c in consumers if c.has_seat(Phase.DECODE)]
        consumer, matched = self._pick(Phase.DECODE, free, avoid, key)
        if consumer is None:
            return None
        consumer.decode_seats += 1
        if panic:
            consumer.panics += 1
        self.placer.placed(Phase.DECODE, consumer.id, key)
        return Reservation(
            self,
            consumer,
            consumer,
            prefill_held=False,
            fallback=True,
            panic=panic,
            prefix_matched=matched,
        )

    def panic_candidates(self, phase: Phase, now: float) -> list[Engine]:
        """Engines of `phase` that are out of placement but may still serve: not refusing
        connections, not breaking the pinned contract."""
        return [
            e
            for e in self.engines
            if e.serves(phase)
            and e.state(now) is not EngineState.ADMITTED
            and not e.draining
            and not e.refusing
            and not e.mismatched
        ]

    def _unservable(self, phase: Phase) -> NarwhalError:
        members = [e for e in self.engines if e.serves(phase)]
        refusing = sum(e.refusing for e in members)
        mismatched = sum(e.mismatched for e in members)
        drained = sum(e.draining for e in members)
        why = [f"{refusing} refuse connections"] if refusing else []
        why += [f"{mismatched} break the engine contract"] if mismatched else []
        why += [f"{drained} drained by an operator"] if drained else []
        return NarwhalError(
            503,
            f"no engine can {phase.value}: none of the {len(members)} is admitted"
            + (f" ({', '.join(why)})" if why else ""),
            Cause.UNAVAILABLE,
            retry_after=1,
        )

    def _pick(
        self, phase: Phase, candidates: list[Engine], avoid: frozenset[str], key: PromptKey | None
    ) -> tuple[Engine | None, int]:
        preferred = [e for e in candidates if e.id not in avoid] or candidates
        return self.placer.choose(phase.value, preferred, key)

    # Waiting for a seat ------------------------------------------------------------

    async def reserve(
        self, avoid: frozenset[str] = frozenset(), key: PromptKey | None = None
    ) -> Reservation:
        """A reservation, waiting in arrival order for up to `queue_timeout_s`.

        The request's own deadline (an enclosing timeout) may end the wait sooner; a
        waiter that leaves for any reason never keeps a seat.
        """
        if not self._queue:
            reservation = self.try_reserve(avoid, key)
            if reservation is not None:
                return reservation
        if len(self._queue) >= self.queue_capacity:
            raise NarwhalError(
                429,
                f"the router's queue is full ({self.queue_capacity} requests wait for a seat; "
                "serving.queue_capacity)",
                Cause.UNAVAILABLE,
                retry_after=1,
            )
        waiter = _Waiter(avoid, key, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
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

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter leaves: seats granted to it in the meantime go back."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().release()
            return
        future.cancel()
        if waiter in self._queue:
            self._queue.remove(waiter)
            self.seat_freed()

    def seat_freed(self) -> None:
        """Grant seats to waiters in arrival order; the head blocks those behind it."""
        if self._draining:
            self._note_drained()
        if self._waking:
            return
        self._waking = True
        try:
            while self._queue:
                head = self._queue[0]
                if head.future.done():
                    self._queue.popleft()
                    continue
                try:
                    reservation = self.try_reserve(head.avoid, head.key)
                except NarwhalError as error:
                    self._queue.popleft()
                    head.future.set_exception(error)
                    continue
                if reservation is None:
                    return
                self._queue.popleft()
                head.future.set_result(reservation)
        finally:
            self._waking = False


def _engine(spec: EngineSpec, share: SeatShare, *, new: bool = False) -> Engine:
    return Engine(spec, pinned=spec.pin, acting=spec.start_as, share=share, new=new)


def _now() -> float:
    return asyncio.get_running_loop().time()

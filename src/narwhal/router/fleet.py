"""The engines the router knows, their phase seats, and placement over them.

Placement is kept apart from the request path: the path asks for a producer and a
consumer and gets back a `Reservation` holding one seat on each, which it must release.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from narwhal.config import EngineSpec
from narwhal.protocol.errors import Cause, NarwhalError


@dataclass(eq=False, slots=True)
class Engine:
    """One engine as the router sees it: its spec and the seats requests hold on it."""

    spec: EngineSpec
    prefill_seats: int = 0
    decode_seats: int = 0

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def load(self) -> int:
        return self.prefill_seats + self.decode_seats


@dataclass(eq=False, slots=True)
class Reservation:
    """A request's seats: one prefill seat on the producer, one decode seat on the consumer.

    Each seat is released exactly once, whichever of `release_prefill`, `release_decode`
    or `release` runs first; later calls are no-ops.
    """

    producer: Engine
    consumer: Engine
    _prefill_held: bool = field(default=True)
    _decode_held: bool = field(default=True)

    @property
    def crossed(self) -> bool:
        return self.producer is not self.consumer

    def release_prefill(self) -> None:
        if self._prefill_held:
            self._prefill_held = False
            self.producer.prefill_seats -= 1

    def release_decode(self) -> None:
        if self._decode_held:
            self._decode_held = False
            self.consumer.decode_seats -= 1

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()


class Fleet:
    """Every configured engine, in configuration order."""

    def __init__(self, specs: Iterable[EngineSpec]) -> None:
        self.engines = [Engine(spec) for spec in specs]
        self.by_id = {engine.id: engine for engine in self.engines}

    def producers(self) -> list[Engine]:
        return [e for e in self.engines if e.spec.role.can_prefill]

    def consumers(self) -> list[Engine]:
        return [e for e in self.engines if e.spec.role.can_decode]

    def can_serve(self) -> bool:
        return bool(self.producers()) and bool(self.consumers())

    def reserve(self) -> Reservation:
        """Pick the least-loaded producer, then the least-loaded other consumer.

        The same engine serves both phases only when no distinct consumer exists.
        """
        producers, consumers = self.producers(), self.consumers()
        if not producers:
            raise NarwhalError(503, "no engine is available for prefill", Cause.UNAVAILABLE)
        if not consumers:
            raise NarwhalError(503, "no engine is available for decode", Cause.UNAVAILABLE)
        producer = min(producers, key=_load_key)
        crossing = [c for c in consumers if c is not producer]
        consumer = min(crossing or consumers, key=_load_key)
        producer.prefill_seats += 1
        consumer.decode_seats += 1
        return Reservation(producer, consumer)


def _load_key(engine: Engine) -> int:
    return engine.load

"""The breaker: which failures count against an engine, and when its streak ejects it.

Outlier detection in Envoy's sense: consecutive failures eject; a success resets the
streak. Everything that decides ejection lives here; readmission lives in `readmission`.

What counts (a table, read top to bottom):

| failure                                                     | counts?  |
|-------------------------------------------------------------|----------|
| decode stream: first-token timeout, silence between tokens, | yes      |
|   closed before [DONE], [DONE] before output, error object, |          |
|   malformed stream                                          |          |
| prefill leg: engine 5xx/408/429, timeout, unreadable answer | yes      |
| a descriptor the producer got wrong                         | yes      |
| connection refused, reset or timed out                      | yes (1)  |
| the client's own 4xx (relayed from the engine)              | no       |
| handoff expired, request deadline, queue admission          | no (2)   |

(1) an engine that cannot be reached is not serving; (2) no engine misbehaved.

A success on a leg resets that engine's streak: a completed prefill whose descriptor
passed validation for the producer, a stream that reached [DONE] for the consumer.

When a streak reaches `eject_after`, the engine is ejected unless that would leave too
little of a phase it serves (Envoy's `max_ejection_percent`). The phase's engines are
counted within the engine's pool (its base model): the cap holds per phase and per model,
and an engine ejected in one pool changes nothing for another.

| the engine...                                           | ejected?               |
|---------------------------------------------------------|------------------------|
| refuses connections (its last failure was `connect`)    | yes: it serves nothing |
| would leave, in every phase it serves, at most          | yes                    |
|   `max_ejected_fraction` of the phase's engines ejected |                        |
|   (one engine may always go while others remain)        |                        |
| otherwise                                               | no: spared, stays in   |

So the breaker alone never empties a phase of engines that accept connections. A spared
engine keeps its streak and is counted (`spared`); its next success resets both. Should a
phase still have no admitted engine (every engine refused connections, quarantine, or
`max_ejected_fraction = 1`), placement degrades instead of refusing (see `fleet`):
aggregate fallback for prefill, panic placement for decode.

An engine an operator drained is out of the count (it is neither a member of its phases
nor ejected) and is never ejected: it takes no new work either way. Its streak still
counts, so a broken engine readmitted by hand is ejected at its next failure.
"""

from __future__ import annotations

import math

from narwhal.fleet.lifecycle import Event
from narwhal.fleet.table import Engine, Fleet, Phase
from narwhal.protocol.errors import Cause, NarwhalError

COUNTED = frozenset(
    {
        Cause.CONNECT,
        Cause.HTTP_STATUS,
        Cause.PREFILL_TIMEOUT,
        Cause.FIRST_TOKEN_TIMEOUT,
        Cause.SILENCE,
        Cause.CLOSED_EARLY,
        Cause.DONE_BEFORE_TOKEN,
        Cause.ERROR_OBJECT,
        Cause.BAD_RESPONSE,
        Cause.DESCRIPTOR,
    }
)


def counts(error: NarwhalError) -> bool:
    """Whether this failure counts against the engine it names."""
    return error.is_engine_fault and error.cause in COUNTED


def may_eject(members: int, ejected: int, fraction: float) -> bool:
    """Whether one more of a phase's `members` may be ejected while `ejected` already are."""
    allowed = math.floor(fraction * members + 1e-9)
    if fraction < 1:
        allowed = min(allowed, members - 1)  # only a cap of 1 may empty a phase
    if members > 1:
        allowed = max(allowed, 1)
    return ejected + 1 <= min(allowed, members)


class Breaker:
    """Per-engine failure streaks over a fleet; ejects at `eject_after` in a row, within
    `max_ejected_fraction` of each phase."""

    def __init__(self, fleet: Fleet, eject_after: int, max_ejected_fraction: float = 0.5) -> None:
        self.fleet = fleet
        self.eject_after = eject_after
        self.max_ejected_fraction = max_ejected_fraction

    def failure(self, error: NarwhalError, *, producer: str | None = None) -> bool:
        """Record a failed leg; True if it ejected the engine.

        `producer` names the producer when the failure was a crossed decode's, so that
        readmission can probe the same pairing.
        """
        engine = self.fleet.by_id.get(error.engine or "")
        if engine is None or not counts(error):
            return False
        engine.streak += 1
        # Any other failure means the engine took the connection.
        engine.refusing = error.cause is Cause.CONNECT
        if engine.ejected or engine.draining or engine.streak < self.eject_after:
            return False
        if not engine.refusing and (phase := self._would_empty(engine)) is not None:
            if not engine.spared:
                engine.spared = True
                engine.spares += 1
                engine.lifecycle.apply(
                    Event.SPARE,
                    self.fleet.emit,
                    f"{engine.streak} consecutive failures, but ejecting it would leave "
                    f"too few {phase} engines{self._of_pool(engine)} "
                    f"(recovery.max_ejected_fraction "
                    f"{self.max_ejected_fraction:g}); last: {error.cause.value}",
                )
            return False
        engine.ejections += 1
        engine.probe_producer = producer if producer != engine.id else None
        engine.ejection_reason = (
            f"{engine.streak} consecutive failures; last: {error.cause.value}: {error.message}"
        )
        engine.lifecycle.apply(Event.EJECT, self.fleet.emit, engine.ejection_reason)
        return True

    def _would_empty(self, engine: Engine) -> Phase | None:
        """The first phase the engine serves that its ejection would take past the cap,
        counted within its own pool (the engines of its base model)."""
        for phase in Phase:
            if not engine.serves(phase):
                continue
            members = [
                e
                for e in self.fleet.engines
                if e.model == engine.model and e.serves(phase) and not e.draining
            ]
            ejected = sum(e.ejected for e in members)
            if not may_eject(len(members), ejected, self.max_ejected_fraction):
                return phase
        return None

    def _of_pool(self, engine: Engine) -> str:
        """` of model X` where the fleet has several pools; nothing for one."""
        return f" of model `{engine.model}`" if self.fleet.catalog.several else ""

    def success(self, engine_id: str) -> None:
        """A leg on this engine succeeded: its streak resets, and it accepts connections."""
        engine = self.fleet.by_id.get(engine_id)
        if engine is not None:
            engine.streak = 0
            engine.spared = False
            engine.refusing = False

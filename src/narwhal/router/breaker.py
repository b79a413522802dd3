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

A success on a leg resets that engine's streak: a completed prefill for the producer, a
stream that reached [DONE] for the consumer.
"""

from __future__ import annotations

from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.router.fleet import EngineEvent, Fleet

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


class Breaker:
    """Per-engine failure streaks over a fleet; ejects at `eject_after` in a row."""

    def __init__(self, fleet: Fleet, eject_after: int) -> None:
        self.fleet = fleet
        self.eject_after = eject_after

    def failure(self, error: NarwhalError, *, producer: str | None = None) -> bool:
        """Record a failed leg; True if it ejected the engine.

        `producer` names the producer when the failure was a crossed decode's, so that
        readmission can probe the same pairing.
        """
        engine = self.fleet.by_id.get(error.engine or "")
        if engine is None or not counts(error):
            return False
        engine.streak += 1
        if engine.ejected or engine.streak < self.eject_after:
            return False
        engine.ejected = True
        engine.ejections += 1
        engine.probe_producer = producer if producer != engine.id else None
        engine.ejection_reason = (
            f"{engine.streak} consecutive failures; last: {error.cause.value}: {error.message}"
        )
        self.fleet.emit(EngineEvent("ejected", engine.id, engine.ejection_reason))
        return True

    def success(self, engine_id: str) -> None:
        engine = self.fleet.by_id.get(engine_id)
        if engine is not None:
            engine.streak = 0

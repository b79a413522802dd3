"""Where a leg's result lands: the one hook between the request path and the fleet's judges.

Every prefill and decode leg ends here exactly once. A failure that is the engine's own
fault counts against it (its failure count in metrics, the breaker, a quarantine); a
success clears the breaker's streak. A request answered in full credits the retry
budgets. Nothing else in the request path touches the breaker, the budgets or an engine's
failure counts.
"""

from __future__ import annotations

from narwhal.fleet.breaker import Breaker
from narwhal.fleet.table import Fleet, Phase, Reservation
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.router.budget import RetryBudget


class Outcome:
    """The breaker, quarantine and the retry budgets, told of each leg's result."""

    def __init__(
        self,
        fleet: Fleet,
        breaker: Breaker,
        budget: RetryBudget,
        continuation_budget: RetryBudget,
        *,
        failure_quarantine_s: float,
    ) -> None:
        self.fleet = fleet
        self.breaker = breaker
        self.budget = budget
        # Continuations spend their own credit, so that they never eat the retries'.
        self.continuation_budget = continuation_budget
        self.failure_quarantine_s = failure_quarantine_s

    def passed(self, reservation: Reservation, phase: Phase) -> None:
        """A leg of `reservation` ended well: its engine's breaker streak clears.

        The prefill leg passes once its descriptor passed validation (a rejected
        descriptor is the producer's failure); an aggregate fallback has no prefill leg.
        """
        if phase is Phase.DECODE:
            self.breaker.success(reservation.consumer.id)
        elif not reservation.fallback:
            self.breaker.success(reservation.producer.id)

    def failed(self, reservation: Reservation, error: NarwhalError) -> None:
        """A leg of `reservation` failed with `error`, judged by the engine it names,
        whichever leg reports it: failures, breaker, quarantine.

        A client's 4xx never counts. A crossed decode's failure remembers its producer,
        so that readmission can probe the same pairing.
        """
        engine = self.fleet.by_id.get(error.engine or "")
        if engine is None or not error.is_engine_fault:
            return
        engine.failures[error.cause.value] = engine.failures.get(error.cause.value, 0) + 1
        crossed_decode = reservation.crossed and engine is reservation.consumer
        producer = reservation.producer.id if crossed_decode else None
        self.breaker.failure(error, producer=producer)
        seconds = self.failure_quarantine_s
        if seconds > 0 and error.cause is not Cause.HANDOFF_EXPIRED and not engine.ejected:
            self.fleet.quarantine(engine, seconds, error.cause.value)

    def answered(self, *, tracked: bool) -> None:
        """A request was answered in full: the budgets earn credit (the continuation
        budget from the requests that could have been continued)."""
        self.budget.on_success()
        if tracked:
            self.continuation_budget.on_success()

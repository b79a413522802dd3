"""The rules every route's continuation shares for its replays' tries (`router.retry.Tries`).

A replay goes to a consumer that has not failed the answer, away from every engine that
failed a replay of it, while `continuation.max_attempts` and the router's continuation
budget allow. What a replay sends (`next_try`) and what it repeats are the route's own:
`router.rescue` for completions and chat, `router.responses_rescue` for Responses.
"""

from __future__ import annotations

import time

from narwhal.config.continuation import ContinuationConfig
from narwhal.fleet.models import Target
from narwhal.fleet.placement import PromptKey
from narwhal.fleet.table import Fleet, Reservation
from narwhal.protocol.errors import NarwhalError
from narwhal.router.call import Call
from narwhal.router.continuation import BUDGET, FLEET, refused_error
from narwhal.router.outcome import Outcome


class Replays:
    """Where a continuation's replays may go and what one more costs."""

    # Its tries continue an answer: the request's first-token figures stay as they were.
    rescue = True

    def __init__(
        self,
        fleet: Fleet,
        outcome: Outcome,
        call: Call,
        key: PromptKey | None,
        target: Target | None,
        settings: ContinuationConfig,
    ) -> None:
        self.fleet = fleet
        self.outcome = outcome
        self.call = call
        self.key = key
        self.target = target
        self.settings = settings
        # The failure that ended the last try, the consumers that failed the answer (never
        # continued on), the engines its replays avoid, and when the consumer failed.
        self.error: NarwhalError | None = None
        self.failed_consumers: set[str] = set()
        self.avoid: set[str] = set()
        self.failed_at = 0.0

    def consumer_failed(self, error: NarwhalError, consumer: str) -> None:
        """The answer's consumer failed after output began: it is not continued on."""
        self.failed_consumers.add(consumer)
        self.avoid.add(consumer)
        self.error, self.failed_at = error, time.perf_counter()

    def spend(self, call: Call) -> None:
        """One more replay's cost; raises when `continuation.max_attempts` are used or the
        router's continuation budget is spent."""
        settings = self.settings
        if call.continuations >= settings.max_attempts:
            raise self._refused(f"continuation.max_attempts ({settings.max_attempts}) used", BUDGET)
        if not self.outcome.continuation_budget.try_spend():
            why = "the router's continuation budget (continuation.budget) is spent"
            raise self._refused(why, BUDGET)

    async def reserve(self, call: Call) -> Reservation:
        try:
            return await self.fleet.reserve(
                frozenset(self.avoid), self.key, self.target, call.claim
            )
        except NarwhalError as unplaced:
            raise self._refused(f"no consumer was placed: {unplaced.message}", FLEET) from None

    def placed(self, call: Call, reservation: Reservation) -> None:
        if reservation.consumer.id in self.failed_consumers:
            raise self._refused("no other consumer is available to continue on", FLEET)
        call.continuations += 1

    def failed(self, call: Call, error: NarwhalError, reservation: Reservation) -> None:
        if error.engine is not None:
            self.avoid.add(error.engine)
            if error.engine == reservation.consumer.id:
                self.failed_consumers.add(error.engine)
        self.error = error

    def _refused(self, why: str, kind: str) -> NarwhalError:
        return refused_error(self.call, self.error, why, kind)

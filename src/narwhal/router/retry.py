"""The one retry loop: place → attempt → relay, again while the rules allow.

A request's first attempts and its continuations (`router.rescue`) run through the same
loop and differ only in their rules (`Tries`): what each try sends, where it may be
placed, and whether a failed try is followed by another. Seats are held by the
reservation's `async with` and released on leaving it, on every path; each leg's result
goes to `Outcome` once.

Retries happen only before any output: once the relay has begun, its failure is returned
to the caller (judged already), which decides whether the answer can be continued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol

from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.responses_stream import ResponsesStream
from narwhal.engines.whole_answer import WholeAnswer
from narwhal.fleet.models import Target
from narwhal.fleet.placement import PromptKey
from narwhal.fleet.table import Fleet, Phase, Reservation
from narwhal.protocol.bodies import ClientRequest
from narwhal.protocol.errors import NarwhalError
from narwhal.router.attempt import Attempt, Leg
from narwhal.router.budget import RetryBudget
from narwhal.router.call import Call, Stage
from narwhal.router.outcome import Outcome

# Forwards a decode's stream to the client, from its first token to its end.
Relay = Callable[[DecodeStream], Awaitable[None]]


@dataclass(slots=True)
class Relayed(Generic[Leg]):
    """The try whose relay ran, on its seats (already released), and how it ended."""

    reservation: Reservation
    stream: Leg
    # The relay's failure (already counted against its engine); None when it ended well.
    error: NarwhalError | None


class Tries(Protocol):
    """The rules of one series of tries."""

    # The tries continue an answer: the request's first-token figures stay as they were.
    @property
    def rescue(self) -> bool: ...

    def next_try(self, call: Call) -> ClientRequest:
        """What the next try sends; raises the error the request ends with when no try
        may follow."""
        ...

    async def reserve(self, call: Call) -> Reservation:
        """The seats for the next try."""
        ...

    def placed(self, call: Call, reservation: Reservation) -> None:
        """The try is placed; raises to refuse the placement (its seats go back)."""
        ...

    def failed(self, call: Call, error: NarwhalError, reservation: Reservation) -> None:
        """A try failed before its first token; raises `error` when no retry follows."""
        ...


def worth_retrying(
    error: NarwhalError, *, attempts: int, max_attempts: int, now: float, deadline: float
) -> bool:
    """A failed first attempt may be tried again: transient, attempts left, deadline not
    passed (the retry budget is asked last, only when this holds)."""
    return error.transient and attempts < max_attempts and now < deadline


class FirstTries:
    """A request's own attempts: up to `serving.max_attempts`, each away from the engines
    that already failed it, while the retry budget has credit."""

    rescue = False

    def __init__(
        self,
        fleet: Fleet,
        request: ClientRequest,
        budget: RetryBudget,
        max_attempts: int,
        target: Target | None = None,
    ) -> None:
        """`target`: the pool and adapter the request's `model` names (`fleet.models`)."""
        self.fleet = fleet
        self.request = request
        self.budget = budget
        self.max_attempts = max_attempts
        self.target = target
        # The prompt's placement key: continuations are placed by it as well.
        scope = target.adapter if target is not None else None
        self.key: PromptKey | None = fleet.placer.key(request.body, scope)
        self.failed_on: set[str] = set()

    def next_try(self, call: Call) -> ClientRequest:
        return self.request

    async def reserve(self, call: Call) -> Reservation:
        return await self.fleet.reserve(
            frozenset(self.failed_on), self.key, self.target, call.claim
        )

    def placed(self, call: Call, reservation: Reservation) -> None:
        pass

    def failed(self, call: Call, error: NarwhalError, reservation: Reservation) -> None:
        now = asyncio.get_running_loop().time()
        attempts, limit = call.attempts, self.max_attempts
        if not worth_retrying(
            error, attempts=attempts, max_attempts=limit, now=now, deadline=call.deadline
        ):
            raise error
        if not self.budget.try_spend():
            call.retry_denied = True
            raise error
        if error.engine is not None:
            self.failed_on.add(error.engine)


class Retries:
    """Runs a series of tries to its relay's end, through `Attempt` and `Outcome`."""

    def __init__(self, attempt: Attempt, outcome: Outcome) -> None:
        self.attempt = attempt
        self.outcome = outcome

    async def run(self, call: Call, tries: Tries, relay: Relay) -> Relayed[DecodeStream]:
        """Tries until one reaches its first token, then relays it.

        Raises the error of the last try when no try reached a first token.
        """
        return await self._run(call, tries, self.attempt.run, relay)

    async def run_whole(
        self, call: Call, tries: Tries, relay: Callable[[WholeAnswer], Awaitable[None]]
    ) -> Relayed[WholeAnswer]:
        """As `run`, with each try's decode asked for whole: a failed whole leg has sent
        the client nothing, so it is retried as a try that failed its first token is."""
        return await self._run(call, tries, self.attempt.run_whole, relay)

    async def run_responses(
        self, call: Call, tries: Tries, relay: Callable[[ResponsesStream], Awaitable[None]]
    ) -> Relayed[ResponsesStream]:
        """As `run`, for a Responses request: each try's decode is a Responses stream."""
        return await self._run(call, tries, self.attempt.run_responses, relay)

    async def _run(
        self,
        call: Call,
        tries: Tries,
        attempt: Callable[..., Awaitable[Leg]],
        relay: Callable[[Leg], Awaitable[None]],
    ) -> Relayed[Leg]:
        while True:
            request = tries.next_try(call)
            call.enter(Stage.QUEUED)
            async with await tries.reserve(call) as reservation:
                tries.placed(call, reservation)
                try:
                    stream = await attempt(call, request, reservation, rescue=tries.rescue)
                except NarwhalError as error:
                    call.attempt_failed(error)
                    self.outcome.failed(reservation, error)
                    tries.failed(call, error, reservation)
                    continue
                try:
                    async with stream:
                        call.enter(Stage.RELAY)
                        await relay(stream)
                except NarwhalError as error:
                    self.outcome.failed(reservation, error)
                    return Relayed(reservation, stream, error)
                self.outcome.passed(reservation, Phase.DECODE)
                return Relayed(reservation, stream, None)

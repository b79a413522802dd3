"""One attempt, on the seats of one reservation: prefill → validate → decode → hand over.

An attempt ends at the decode's first token, with the stream handed to the relay (or, with
a decode asked for whole, at the consumer's whole answer), or with the error that ended
it. Each attempt has fresh engine request ids and its own handoff; a descriptor that never
reached a consumer is recorded as abandoned (its producer holds the blocks) and, when the
operator asks, released through a consumer of the same pool.

A request's legs are bounded by its pool's own timeouts where its base model's
`[[models]]` entry sets some (`engine` there), else by `[engine]`'s: the bounds are made
once, here, at startup, and a model without overrides passes none (the client's own).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TypeVar

from narwhal.config.root import Config
from narwhal.engines.client import LegBounds, new_request_id
from narwhal.engines.connector import Delivery, PrefillResult
from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.responses_stream import ResponsesStream
from narwhal.engines.whole_answer import WholeAnswer
from narwhal.fleet.table import Engine, Fleet, Phase, Reservation
from narwhal.protocol.bodies import ClientRequest
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.router.abandoned import AbandonedHandoffs, abandonment
from narwhal.router.call import Call, Stage
from narwhal.router.continuation import with_token_ids
from narwhal.router.outcome import Outcome
from narwhal.router.releases import Releases

# What a decode leg hands the relay: a stream past its first token (a Responses stream on
# `/v1/responses`), or a whole answer.
Leg = TypeVar("Leg", DecodeStream, WholeAnswer, ResponsesStream)
Leg_co = TypeVar("Leg_co", DecodeStream, WholeAnswer, ResponsesStream, covariant=True)


class Legs(Protocol):
    """The engine client's calls an attempt makes (`engines.client.EngineClient`)."""

    async def prefill(
        self,
        producer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        *,
        same_worker: bool = False,
        request_id: str | None = None,
        engine: str | None = None,
        kv_hosts: Iterable[str] = (),
        trace: bytes = b"",
        bounds: LegBounds | None = None,
    ) -> PrefillResult: ...

    async def handoff_descriptor(
        self, consumer_url: str, endpoint: str, result: PrefillResult
    ) -> bytes | None: ...

    async def send_decode(
        self,
        consumer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        engine: str | None = None,
        drop_usage: bool = False,
        trace: bytes = b"",
        delivery: Delivery | None = None,
        bounds: LegBounds | None = None,
    ) -> DecodeStream: ...

    async def send_whole(
        self,
        consumer_url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        engine: str | None = None,
        timeout_s: float = 0.0,
        trace: bytes = b"",
        delivery: Delivery | None = None,
    ) -> WholeAnswer: ...

    async def send_responses(
        self,
        consumer_url: str,
        body: Mapping[str, Any],
        result: PrefillResult,
        descriptor: bytes | None,
        *,
        rewrite: Mapping[str, Any],
        engine: str | None = None,
        trace: bytes = b"",
        delivery: Delivery | None = None,
        bounds: LegBounds | None = None,
    ) -> ResponsesStream: ...


class Decode(Protocol[Leg_co]):
    """Sends an attempt's decode leg: `Attempt._stream` or `Attempt._whole`."""

    async def __call__(
        self,
        call: Call,
        request: ClientRequest,
        url: str,
        engine: str,
        result: PrefillResult,
        descriptor: bytes | None,
        delivery: Delivery,
        bounds: LegBounds | None,
    ) -> Leg_co: ...


def model_bounds(config: Config) -> dict[str, LegBounds]:
    """Each base model's leg bounds, for the models whose `[[models]]` entry overrides
    some of `[engine]`'s; the others are absent (they take the client's own)."""
    engine = config.engine
    bounds: dict[str, LegBounds] = {}
    for model in config.models:
        if not model.engine:
            continue
        own = model.engine
        bounds[model.name] = LegBounds(
            prefill_timeout_s=own.get("prefill_timeout_s", engine.prefill_timeout_s),
            first_token_timeout_s=own.get("first_token_timeout_s", engine.first_token_timeout_s),
            decode_read_timeout_s=own.get("decode_read_timeout_s", engine.decode_read_timeout_s),
            whole_answer_timeout_s=own.get("whole_answer_timeout_s", engine.whole_answer_timeout_s),
        )
    return bounds


class Attempt:
    """The legs of one try, sent through the engine client."""

    def __init__(
        self,
        config: Config,
        client: Legs,
        fleet: Fleet,
        outcome: Outcome,
        abandoned: AbandonedHandoffs,
        releases: Releases,
    ) -> None:
        self.client = client
        self.fleet = fleet
        self.outcome = outcome
        self.abandoned = abandoned
        self.releases = releases
        self.handoff_bound_s = config.handoff_bound_s
        self.kv_lease_s = config.engine.kv_lease_s
        self.release_abandoned = config.engine.release_abandoned
        self.whole_answer_timeout_s = config.engine.whole_answer_timeout_s
        self.bounds = model_bounds(config)

    async def run(
        self,
        call: Call,
        request: ClientRequest,
        reservation: Reservation,
        *,
        rescue: bool = False,
    ) -> DecodeStream:
        """One prefill/decode try, up to the decode's first token.

        With `rescue`, the try continues an answer (`router.rescue`): the request's own
        first-token measurements and prompt count stay as they were.
        """
        return await self._run(call, request, reservation, rescue, self._stream)

    async def run_whole(
        self,
        call: Call,
        request: ClientRequest,
        reservation: Reservation,
        *,
        rescue: bool = False,
    ) -> WholeAnswer:
        """One prefill/decode try whose decode is asked for whole, up to its answer: the
        answer's arrival is the request's first byte (and, with no prefill, its first
        token)."""
        return await self._run(call, request, reservation, rescue, self._whole)

    async def run_responses(
        self,
        call: Call,
        request: ClientRequest,
        reservation: Reservation,
        *,
        rescue: bool = False,
    ) -> ResponsesStream:
        """One prefill/decode try of a Responses request, up to its first output delta."""
        return await self._run(call, request, reservation, rescue, self._responses)

    async def _run(
        self,
        call: Call,
        request: ClientRequest,
        reservation: Reservation,
        rescue: bool,
        decode: Decode[Leg],
    ) -> Leg:
        producer, consumer = reservation.producer, reservation.consumer
        target = reservation.target
        bounds = self.bounds.get(target.base) if self.bounds and target is not None else None
        call.attempts += 1
        call.producer = None if reservation.fallback else producer.id
        call.consumer = consumer.id
        call.prefix_matched = reservation.prefix_matched
        backend_id = new_request_id()
        call.backend_request_ids.append(backend_id)
        call.panic = call.panic or reservation.panic
        if reservation.fallback:
            # Aggregate fallback: the consumer computes the prompt itself; no prefill leg.
            now = asyncio.get_running_loop().time()
            result = PrefillResult(
                consumer.url, request.endpoint, backend_id, None, now, same_worker=True
            )
        else:
            call.enter(Stage.PREFILL)
            result = await self.client.prefill(
                producer.url,
                request.endpoint,
                request.body,
                same_worker=not reservation.crossed,
                request_id=backend_id,
                engine=producer.id,
                kv_hosts=producer.spec.kv_hosts,
                trace=call.leg_headers(),
                bounds=bounds,
            )
            reservation.release_prefill()
            if not rescue:
                call.ttft_s = time.perf_counter() - call.arrival
                call.prompt_tokens = result.prompt_tokens
        delivery = Delivery()
        try:
            return await self._hand_over(
                call, request, reservation, result, delivery, rescue, decode, bounds
            )
        except BaseException as exc:
            if not delivery.delivered:
                # A consumer that just failed the decode itself is the last to release it.
                failed = (
                    isinstance(exc, NarwhalError)
                    and exc.engine == consumer.id
                    and exc.is_engine_fault
                )
                self._abandon(call, result, reservation, consumer_failed=failed)
            raise

    async def _hand_over(
        self,
        call: Call,
        request: ClientRequest,
        reservation: Reservation,
        result: PrefillResult,
        delivery: Delivery,
        rescue: bool,
        decode: Decode[Leg],
        bounds: LegBounds | None,
    ) -> Leg:
        """From the prefill's answer to the decode's first token (or whole answer);
        `delivery` says whether the descriptor reached the consumer, whatever happens."""
        producer, consumer = reservation.producer, reservation.consumer
        if reservation.fallback:
            call.handoff = "fallback"
        else:
            call.enter(Stage.HANDOFF)
            call.handoff = self._handoff_kind(reservation, result)
        call.handoffs.append(call.handoff)
        endpoint = request.endpoint
        try:
            descriptor = await self.client.handoff_descriptor(consumer.url, endpoint, result)
            call.enter(Stage.DECODE)
            leg = await decode(
                call, request, consumer.url, consumer.id, result, descriptor, delivery, bounds
            )
        except NarwhalError as error:
            # The descriptor passed validation unless the producer is the one blamed.
            if error.engine != producer.id:
                self.outcome.passed(reservation, Phase.PREFILL)
            raise
        self.outcome.passed(reservation, Phase.PREFILL)
        if call.handoff == "crossed":
            consumer.crossed_decodes += 1
        if not rescue:
            call.first_byte_s = time.perf_counter() - call.arrival
            if reservation.fallback:
                call.ttft_s = call.first_byte_s
        return leg

    async def _stream(
        self,
        call: Call,
        request: ClientRequest,
        url: str,
        engine: str,
        result: PrefillResult,
        descriptor: bytes | None,
        delivery: Delivery,
        bounds: LegBounds | None,
    ) -> DecodeStream:
        return await self.client.send_decode(
            url,
            request.endpoint,
            # A tracked request's ids come from its decode alone (`router.progress`).
            with_token_ids(request.body) if call.tracks_ids else request.body,
            result,
            descriptor,
            engine=engine,
            drop_usage=not request.include_usage,
            trace=call.leg_headers(),
            delivery=delivery,
            bounds=bounds,
        )

    async def _whole(
        self,
        call: Call,
        request: ClientRequest,
        url: str,
        engine: str,
        result: PrefillResult,
        descriptor: bytes | None,
        delivery: Delivery,
        bounds: LegBounds | None,
    ) -> WholeAnswer:
        timeout_s = self.whole_answer_timeout_s if bounds is None else bounds.whole_answer_timeout_s
        return await self.client.send_whole(
            url,
            request.endpoint,
            request.body,
            result,
            descriptor,
            engine=engine,
            timeout_s=timeout_s,
            trace=call.leg_headers(),
            delivery=delivery,
        )

    async def _responses(
        self,
        call: Call,
        request: ClientRequest,
        url: str,
        engine: str,
        result: PrefillResult,
        descriptor: bytes | None,
        delivery: Delivery,
        bounds: LegBounds | None,
    ) -> ResponsesStream:
        ask = request.ask
        assert ask is not None
        return await self.client.send_responses(
            url,
            request.body,
            result,
            descriptor,
            rewrite={"previous_response_id": ask.previous_response_id, "store": ask.store},
            engine=engine,
            trace=call.leg_headers(),
            delivery=delivery,
            bounds=bounds,
        )

    def _handoff_kind(self, reservation: Reservation, result: PrefillResult) -> str:
        """How the prefill hands over; raises when its descriptor is too old to decode."""
        if not reservation.crossed:
            return "same_worker"
        if result.descriptor is None:
            return "recomputed"
        age, bound = result.age(asyncio.get_running_loop().time()), self.handoff_bound_s
        if age > bound:
            producer = reservation.producer.id
            raise engine_error(
                Cause.HANDOFF_EXPIRED,
                f"handoff expired: the descriptor from engine {producer} was "
                f"{age:.1f} s old, past the {bound:g} s bound (engine.kv_lease_s less "
                "a sixth); its decode was not sent",
                producer,
            )
        return "crossed"

    def _abandon(
        self,
        call: Call,
        result: PrefillResult,
        reservation: Reservation,
        *,
        consumer_failed: bool = False,
    ) -> None:
        """A descriptor dropped before reaching a consumer: nobody will pull its blocks,
        which its producer holds until the KV lease ends (a null descriptor holds none),
        unless a consumer releases them (`engine.release_abandoned`).

        The release goes to a consumer of the handoff's pool: the one chosen, else another
        admitted there; when the chosen one's own failure dropped the descriptor (it
        refused the decode with a fault of its own, or could not be reached), another
        admitted one first and the chosen one last. A consumer of another base model could
        not pair with the producer (its connector refuses a transfer across models), so it
        could not free the blocks."""
        now = asyncio.get_running_loop().time()
        lost = abandonment(
            result.producer, result.descriptor, result.started_at, now, self.kv_lease_s
        )
        if lost is None or result.descriptor is None:
            return
        self.abandoned.record(lost)
        call.abandoned.append(lost)
        if not self.release_abandoned or lost.pinned_s <= 0:
            return
        chosen = reservation.consumer
        others = [
            c
            for c in self.fleet.admitted(Phase.DECODE, now, self._pool(reservation))
            if c is not chosen
        ]
        consumers = [*others, chosen] if consumer_failed else [chosen, *others]
        consumer = next((c for c in consumers if not c.refusing), None)
        if consumer is not None:
            self.releases.start(consumer.url, result, lost)

    def _pool(self, reservation: Reservation) -> list[Engine] | None:
        """The engines of the reservation's pool (its target's base model, else its
        producer's); None (the whole fleet) with one pool."""
        if not self.fleet.catalog.several:
            return None
        target = reservation.target
        return self.fleet.pool(reservation.producer.model if target is None else target.base)

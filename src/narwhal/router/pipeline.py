"""The request path, top to bottom: admission → placement → prefill → validate → decode →
relay → outcome.

`Router.handle` owns one client request: its deadline, its seats and its engine
connections end with it on every path, and it records exactly one outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from narwhal.config.root import Config
from narwhal.config.secrets import Secrets
from narwhal.config.tracing import resolve_tracing
from narwhal.control.loop import ControlLoop
from narwhal.control.phase_latency import PhaseLatency
from narwhal.engines.client import EngineClient, new_request_id
from narwhal.engines.connector import Delivery, PrefillResult
from narwhal.engines.decode_stream import DecodeStream
from narwhal.engines.kv_events import KvEventFeeds
from narwhal.fleet.breaker import Breaker
from narwhal.fleet.discovery import FleetDiscovery
from narwhal.fleet.engine_reports import EngineReports
from narwhal.fleet.operations import FleetOperations
from narwhal.fleet.readmission import Readmission
from narwhal.fleet.seat_share import SeatShare
from narwhal.fleet.table import EngineEvent, Fleet, Phase, Reservation
from narwhal.observe.events import engine_entry, log_call, log_engine_event
from narwhal.observe.journal import Journal
from narwhal.observe.metrics import RouterMetrics
from narwhal.observe.recent import RecentCalls
from narwhal.observe.state import snapshot
from narwhal.protocol.bodies import ClientRequest, Endpoint, parse_client_request
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.protocol.ids import new_id
from narwhal.protocol.tracecontext import passthrough
from narwhal.router.abandoned import AbandonedHandoffs, abandonment
from narwhal.router.budget import RetryBudget
from narwhal.router.call import CLIENT_CLOSED, Call, CallHook, Stage
from narwhal.router.continuation import (
    ContinuationCounts,
    not_continued,
    tracker,
    with_token_ids,
)
from narwhal.router.releases import Releases
from narwhal.router.reply import Reply
from narwhal.router.rescue import Rescue
from narwhal.router.respond import answer_error, collect, relay
from narwhal.runtime.clock import clock

if TYPE_CHECKING:
    from narwhal.observe.tracing import Tracing


def shutting_down() -> NarwhalError:
    return NarwhalError(
        503, "the router is shutting down; retry shortly", Cause.UNAVAILABLE, retry_after=1
    )


def shut_down() -> NarwhalError:
    return NarwhalError(
        503, "the router shut down before this request finished", Cause.UNAVAILABLE, retry_after=1
    )


class Router:
    """Everything a request needs, built once from the configuration."""

    def __init__(
        self,
        config: Config,
        secrets: Secrets | None = None,
        config_path: Path | None = None,
        *,
        tracing: Tracing | None = None,
        journal_stamp: Mapping[str, object] | None = None,
        seat_share: SeatShare | None = None,
    ) -> None:
        """`seat_share`: a worker's part of the seat limits; by default, the replica's
        (`server.replicas`)."""
        # The configuration the router started with; the engine list lives in `fleet`, which
        # operators change at runtime (`operations`, re-reading `config_path` on reload).
        self.config = config
        # None: off, and the request path only passes the client's trace context on.
        self.tracing = tracing or _start_tracing(config)
        self.fleet = Fleet(
            config.engines,
            queue_capacity=config.serving.queue_capacity,
            queue_timeout_s=config.serving.queue_timeout_s,
            share=seat_share or SeatShare(replicas=config.server.replicas),
            placement=config.placement,
        )
        # The engines' own KV cache events keep placement's prefix index right.
        self.kv_events = KvEventFeeds(config.placement.kv_events, self.fleet.placer.cache_changed)
        timeouts = config.engine
        self.client = EngineClient(
            connect_timeout_s=timeouts.connect_timeout_s,
            prefill_timeout_s=timeouts.prefill_timeout_s,
            first_token_timeout_s=timeouts.first_token_timeout_s,
            decode_read_timeout_s=timeouts.decode_read_timeout_s,
            headers=(secrets or Secrets()).engine_headers(),
            ca_bundle=timeouts.ca_bundle,
        )
        self.budget = RetryBudget(config.serving.retry_budget, config.serving.retry_replenish)
        # Continuations spend their own credit, so that they never eat the retries'.
        self.continuation_budget = RetryBudget(
            config.continuation.budget, config.continuation.replenish
        )
        self.breaker = Breaker(
            self.fleet, config.recovery.eject_after, config.recovery.max_ejected_fraction
        )
        self.readmission = Readmission(config, self.fleet, self.client)
        self._readmitting: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[None] | None = None
        self.journal = Journal(
            Path(config.journal.path) if config.journal.path else None, journal_stamp
        )
        self.in_flight = 0
        self.draining = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._shutdown_cancelled: set[asyncio.Task[Any]] = set()
        self.recent = RecentCalls()
        self.abandoned = AbandonedHandoffs()
        self.releases = Releases(self.client, self.abandoned, config.engine.connect_timeout_s)
        self.metrics = RouterMetrics(self)
        # After its journal line, each request feeds the fleet page, metrics and logs.
        self.continuation_counts = ContinuationCounts()
        self.call_hooks: list[CallHook] = [
            self.recent.add,
            self.metrics.observe,
            log_call,
            self.continuation_counts.add,
        ]
        # Told as each request's first token goes out to its client.
        self.first_token_hooks: list[CallHook] = []
        # As each request arrives, before anything can fail (a worker's ledger).
        self.arrival_hooks: list[Callable[[Call], None]] = []
        self.fleet.listeners += [self._journal_engine_event, log_engine_event]
        # After the journal's listener, so that an engine's `drained` precedes its `removed`.
        self.operations = FleetOperations(self.fleet, config, config_path)
        # Engines found as pods, only when `[discovery] enabled`.
        self.discovery = (
            FleetDiscovery(config.discovery, self.fleet, self.operations)
            if config.discovery.enabled
            else None
        )
        # The role controller, only when `[controller] enabled`.
        self.controller: ControlLoop | None = None
        self._controlling: asyncio.Task[None] | None = None
        if config.controller.enabled:
            latency = PhaseLatency()
            self.call_hooks.append(latency.add)
            self.first_token_hooks.append(latency.first_token)
            self.controller = ControlLoop(
                self.fleet, self.operations, config.controller, config.slo, latency
            )

    async def start(self) -> None:
        await self.client.__aenter__()
        self.journal.start()
        self.metrics.start()
        self.kv_events.start()
        self._readmitting = asyncio.create_task(self.readmission.run(), name="readmission")
        interval = self.config.engine.metrics_interval_s
        if interval > 0:
            reports = EngineReports(
                self.fleet, self.client.session, interval, self.config.engine.health_timeout_s
            )
            self._reading = asyncio.create_task(reports.run(), name="engine-reports")
        if self.controller is not None:
            self._controlling = asyncio.create_task(self.controller.run(), name="role-controller")
        if self.discovery is not None:
            self.discovery.start()

    async def stop(self) -> None:
        await self.releases.close()
        await self.kv_events.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        for task in (self._readmitting, self._reading, self._controlling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.metrics.stop()
        await self.client.__aexit__(None, None, None)
        await self.journal.close()
        if self.tracing is not None:
            # Exports what is still batched; it blocks, so off the loop.
            await asyncio.to_thread(self.tracing.shutdown)

    def _journal_engine_event(self, event: EngineEvent) -> None:
        self.journal.record(engine_entry(event))

    def state(self) -> dict[str, Any]:
        """What `/narwhal/state` shows (see `observe.state`)."""
        return snapshot(self)

    # The request path --------------------------------------------------------------

    async def handle(self, reply: Reply, endpoint: Endpoint) -> None:
        """Serve one client request and record its one outcome, on every path."""
        call = Call(
            request_id=new_id(),
            client_request_id=reply.header("X-Request-Id"),
            endpoint=endpoint,
            arrival=time.perf_counter(),
            deadline=asyncio.get_running_loop().time() + self.config.serving.request_timeout_s,
        )
        traceparent = reply.header("traceparent")
        if self.tracing is not None:
            call.trace = self.tracing.begin(call, traceparent, reply.header("tracestate"))
        elif traceparent is not None:
            call.trace_lines = passthrough(traceparent, reply.header("tracestate"))
        self.in_flight += 1
        for arrived in self.arrival_hooks:
            arrived(call)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                if self.draining:
                    raise shutting_down()
                async with clock().timeout_at(call.deadline):
                    await self._serve(reply, call)
            except TimeoutError:
                raise NarwhalError(
                    504,
                    "request exceeded its deadline of "
                    f"{self.config.serving.request_timeout_s:g} s (serving.request_timeout_s) "
                    f"while {call.stage.value}",
                    Cause.DEADLINE,
                ) from None
            except ConnectionResetError:
                call.status, call.error = CLIENT_CLOSED, "client closed the connection"
        except NarwhalError as error:
            call.fail(error)
            await answer_error(reply, call, error)
        except asyncio.CancelledError:
            if not self._shut_out(task):
                call.status, call.error = CLIENT_CLOSED, "client closed the connection"
                raise
            # The router is stopping and this request outlived the grace period.
            ended = shut_down()
            call.fail(ended)
            await answer_error(reply, call, ended)
        finally:
            self.in_flight -= 1
            self._tasks.discard(task)
            now = time.perf_counter()
            call.finish(now)
            if call.trace is not None:
                call.trace.end(call, now)
            if self.journal.writing:
                self.journal.record(call.entry(now))
            for hook in self.call_hooks:
                hook(call, now)

    async def drain(self, grace_s: float) -> None:
        """Graceful shutdown: refuse new requests, let running ones finish for `grace_s`,
        then end the rest (a terminal error event on committed streams)."""
        self.draining = True
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        remaining = [task for task in self._tasks if not task.done()]
        for task in remaining:
            self._shutdown_cancelled.add(task)
            task.cancel()
        if remaining:
            await asyncio.wait(remaining, timeout=5.0)

    def _shut_out(self, task: asyncio.Task[Any] | None) -> bool:
        """Whether this cancellation is the router's own shutdown, not the client leaving."""
        if task is None or task not in self._shutdown_cancelled:
            return False
        self._shutdown_cancelled.discard(task)
        task.uncancel()
        return True

    async def _serve(self, reply: Reply, call: Call) -> None:
        client_request = parse_client_request(
            call.endpoint, await reply.body(self.config.server.client_timeout_s), self.config.model
        )
        call.stream = client_request.stream
        progress = tracker(self.config.continuation, client_request)
        call.tracks_ids = progress is not None
        reservation, stream = await self._open(call, client_request)
        if progress is not None:
            rescue = Rescue(self, reply, call, client_request, progress)
            await rescue.serve(reservation, stream)
            return
        try:
            async with stream:
                call.enter(Stage.RELAY)
                for hook in self.first_token_hooks:
                    hook(call, call.stage_at)
                if client_request.stream:
                    await relay(reply, call, stream)
                else:
                    await collect(reply, call, stream)
        except NarwhalError as error:
            self._blame(error, reservation)
            if error.is_engine_fault and error.engine == reservation.consumer.id:
                not_continued(call, client_request, self.config.continuation)
            raise
        finally:
            reservation.release()
        self.breaker.success(reservation.consumer.id)
        self.budget.on_success()

    async def _open(
        self, call: Call, client_request: ClientRequest
    ) -> tuple[Reservation, DecodeStream]:
        """Attempts until one has produced a first token; retries only before any output."""
        failed_on: set[str] = set()
        key = self.fleet.placer.key(client_request.body)
        while True:
            call.enter(Stage.QUEUED)
            reservation = await self.fleet.reserve(frozenset(failed_on), key)
            try:
                return reservation, await self._attempt(call, client_request, reservation)
            except NarwhalError as error:
                reservation.release()
                call.attempt_failed(error)
                self._blame(error, reservation)
                if not self._may_retry(call, error):
                    raise
                if error.engine is not None:
                    failed_on.add(error.engine)
            except BaseException:
                reservation.release()
                raise

    async def _attempt(
        self,
        call: Call,
        client_request: ClientRequest,
        reservation: Reservation,
        *,
        rescue: bool = False,
    ) -> DecodeStream:
        """One prefill/decode try, up to the decode's first token. Fresh ids, fresh handoff.

        With `rescue`, the try continues an answer (`router.rescue`): the request's own
        first-token measurements and prompt count stay as they were.
        """
        endpoint = client_request.endpoint
        loop = asyncio.get_running_loop()
        producer, consumer = reservation.producer, reservation.consumer
        call.attempts += 1
        call.producer = None if reservation.fallback else producer.id
        call.consumer = consumer.id
        call.prefix_matched = reservation.prefix_matched
        backend_id = new_request_id()
        call.backend_request_ids.append(backend_id)

        call.panic = call.panic or reservation.panic
        if reservation.fallback:
            # Aggregate fallback: the consumer computes the prompt itself; no prefill leg.
            result = PrefillResult(
                consumer.url, endpoint, backend_id, None, loop.time(), same_worker=True
            )
        else:
            call.enter(Stage.PREFILL)
            result = await self.client.prefill(
                producer.url,
                endpoint,
                client_request.body,
                same_worker=not reservation.crossed,
                request_id=backend_id,
                engine=producer.id,
                kv_hosts=producer.spec.kv_hosts,
                trace=call.leg_headers(),
            )
            reservation.release_prefill()
            if not rescue:
                call.ttft_s = time.perf_counter() - call.arrival
                call.prompt_tokens = result.prompt_tokens
        delivery = Delivery()
        try:
            return await self._hand_over(
                call, client_request, reservation, result, delivery, rescue=rescue
            )
        except BaseException:
            if not delivery.delivered:
                self._abandon(call, result, reservation)
            raise

    async def _hand_over(
        self,
        call: Call,
        client_request: ClientRequest,
        reservation: Reservation,
        result: PrefillResult,
        delivery: Delivery,
        *,
        rescue: bool,
    ) -> DecodeStream:
        """From the prefill's answer to the decode's first token; `delivery` says whether
        the descriptor reached the consumer, whatever happens."""
        endpoint = client_request.endpoint
        producer, consumer = reservation.producer, reservation.consumer
        if reservation.fallback:
            call.handoff = "fallback"
        else:
            call.enter(Stage.HANDOFF)
            now = asyncio.get_running_loop().time()
            call.handoff = self._handoff_kind(reservation, result, now)
        call.handoffs.append(call.handoff)
        try:
            descriptor = await self.client.handoff_descriptor(consumer.url, endpoint, result)
            call.enter(Stage.DECODE)
            body = client_request.body
            stream = await self.client.send_decode(
                consumer.url,
                endpoint,
                # A tracked request's ids come from its decode alone (`router.progress`).
                with_token_ids(body) if call.tracks_ids else body,
                result,
                descriptor,
                engine=consumer.id,
                drop_usage=not client_request.include_usage,
                trace=call.leg_headers(),
                delivery=delivery,
            )
        except NarwhalError as error:
            if error.engine != producer.id:
                self._prefill_succeeded(reservation)
            raise
        self._prefill_succeeded(reservation)
        if call.handoff == "crossed":
            consumer.crossed_decodes += 1
        if rescue:
            return stream
        call.first_byte_s = time.perf_counter() - call.arrival
        if reservation.fallback:
            call.ttft_s = call.first_byte_s
        return stream

    def _abandon(self, call: Call, result: PrefillResult, reservation: Reservation) -> None:
        """A descriptor dropped before reaching a consumer: nobody will pull its blocks,
        which its producer holds until the KV lease ends (a null descriptor holds none),
        unless a consumer releases them (`engine.release_abandoned`)."""
        lost = abandonment(
            result.producer,
            result.descriptor,
            result.started_at,
            asyncio.get_running_loop().time(),
            self.config.engine.kv_lease_s,
        )
        if lost is None or result.descriptor is None:
            return
        self.abandoned.record(lost)
        call.abandoned.append(lost)
        if not self.config.engine.release_abandoned or lost.pinned_s <= 0:
            return
        consumers = [reservation.consumer, *self.fleet.admitted(Phase.DECODE)]
        consumer = next((c for c in consumers if not c.refusing), None)
        if consumer is not None:
            self.releases.start(consumer.url, result, lost)

    def _prefill_succeeded(self, reservation: Reservation) -> None:
        """The producer's leg counts as a success once its descriptor passed validation
        (a rejected descriptor is the producer's failure, not a success)."""
        if not reservation.fallback:
            self.breaker.success(reservation.producer.id)

    def _handoff_kind(self, reservation: Reservation, result: PrefillResult, now: float) -> str:
        """How the prefill hands over; raises when its descriptor is too old to decode."""
        if not reservation.crossed:
            return "same_worker"
        if result.descriptor is None:
            return "recomputed"
        age, bound = result.age(now), self.config.handoff_bound_s
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

    def _blame(self, error: NarwhalError, reservation: Reservation) -> None:
        """Count an engine's own fault against it: failures, breaker, quarantine.

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
        seconds = self.config.recovery.failure_quarantine_s
        if seconds > 0 and error.cause is not Cause.HANDOFF_EXPIRED and not engine.ejected:
            self.fleet.quarantine(engine, seconds, error.cause.value)

    def _may_retry(self, call: Call, error: NarwhalError) -> bool:
        """Transient, attempts left, deadline not passed, and the budget has credit."""
        if not error.transient or call.attempts >= self.config.serving.max_attempts:
            return False
        if asyncio.get_running_loop().time() >= call.deadline:
            return False
        if not self.budget.try_spend():
            call.retry_denied = True
            return False
        return True


def _start_tracing(config: Config) -> Tracing | None:
    """Tracing as `[tracing]` and the OTEL_* environment ask for it; None when off.

    The tracing library is imported only here, so a router without tracing never loads it.
    """
    settings = resolve_tracing(config.tracing, os.environ)
    if settings is None:
        return None
    from narwhal.observe.tracing import Tracing

    return Tracing.start(settings, config.model)

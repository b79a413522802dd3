"""The process, assembled: every part built once from the configuration and wired together.

This is the one place that knows all the parts: the engine client, the fleet and its
judges (breaker, readmission, engine reports), the request path, the observers (journal,
metrics, recent calls, logs, tracing), the role controller and discovery. Every task that
outlives a request runs in its `Background`, started by `start` and ended by `stop`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from narwhal.config.environment import process_environment
from narwhal.config.responses import ResponsesConfig
from narwhal.config.root import Config
from narwhal.config.secrets import Secrets
from narwhal.config.tracing import resolve_tracing
from narwhal.control.loop import ControlLoop
from narwhal.control.phase_latency import PhaseLatency
from narwhal.conversations.record import ConversationStore
from narwhal.engines.client import EngineClient
from narwhal.engines.kv_events import KvEventFeeds
from narwhal.fleet.adapters import Adapters
from narwhal.fleet.breaker import Breaker
from narwhal.fleet.discovery import FleetDiscovery
from narwhal.fleet.engine_reports import EngineReports
from narwhal.fleet.models import Catalog
from narwhal.fleet.operations import FleetOperations
from narwhal.fleet.readmission import Readmission
from narwhal.fleet.seat_share import SeatShare
from narwhal.fleet.served import ServedReader
from narwhal.fleet.table import Fleet
from narwhal.observe.events import EngineLines, log_call, log_engine_event
from narwhal.observe.journal import Journal
from narwhal.observe.metrics import RouterMetrics
from narwhal.observe.recent import RecentCalls
from narwhal.observe.state import snapshot
from narwhal.protocol.bodies import Endpoint
from narwhal.router.abandoned import AbandonedHandoffs
from narwhal.router.admission import Admission
from narwhal.router.attempt import Attempt
from narwhal.router.budget import RetryBudget
from narwhal.router.call import Call, CallHook
from narwhal.router.continuation import ContinuationCounts
from narwhal.router.outcome import Outcome
from narwhal.router.releases import Releases
from narwhal.router.reply import Reply
from narwhal.router.request import RequestPath
from narwhal.router.responses import Conversations
from narwhal.router.retry import Retries
from narwhal.runtime.background import Background
from narwhal.tenants.limits import TenantLimits
from narwhal.tenants.store import LimitStore, LocalStore

if TYPE_CHECKING:
    from narwhal.observe.tracing import Tracing


@dataclass(frozen=True, slots=True)
class Hooks:
    """A caller's own hooks on each request (a worker's ledger): told as it arrives and
    once it ended, after the router's own."""

    arrival: Sequence[Callable[[Call], None]] = field(default=())
    ended: Sequence[CallHook] = field(default=())


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
        hooks: Hooks | None = None,
        limit_store: LimitStore | None = None,
    ) -> None:
        """`seat_share`: a worker's part of the seat limits; by default, the replica's
        (`server.replicas`). `hooks`: the caller's own, on each request. `limit_store`:
        where tenants' limits are kept (a worker's is shared with the other workers); by
        default in this process."""
        hooks = hooks or Hooks()
        secrets = secrets or Secrets()
        # The configuration the router started with; the engine list lives in `fleet`, which
        # operators change at runtime (`operations`, re-reading `config_path` on reload).
        self.config = config
        self.background = Background()
        # None: off, and the request path only passes the client's trace context on.
        self.tracing = tracing or _start_tracing(config)
        self.fleet = Fleet(
            config.engines,
            queue_capacity=config.serving.queue_capacity,
            queue_timeout_s=config.serving.queue_timeout_s,
            share=seat_share or SeatShare(replicas=config.server.replicas),
            placement=config.placement,
            catalog=Catalog.from_config(config),
            lora=config.lora,
            reserved_seats=config.tenants_policy.reserved_seats if config.tenants else 0,
        )
        # The engines' own KV cache events keep placement's prefix index right.
        self.kv_events = KvEventFeeds(config.placement.kv_events, self.fleet.placer.cache_changed)
        timeouts = config.engine
        self.client = EngineClient(
            connect_timeout_s=timeouts.connect_timeout_s,
            prefill_timeout_s=timeouts.prefill_timeout_s,
            first_token_timeout_s=timeouts.first_token_timeout_s,
            decode_read_timeout_s=timeouts.decode_read_timeout_s,
            headers=secrets.engine_headers(),
            ca_bundle=timeouts.ca_bundle,
        )
        # LoRA adapters loaded where placement wants them, with `[lora] load_on_demand`.
        self.adapters = Adapters(
            self.fleet, lambda: self.client.session, self.client.headers, config.lora
        )
        if config.lora.load_on_demand:
            self.fleet.prepare = self.adapters.prepare
        self.budget = RetryBudget(config.serving.retry_budget, config.serving.retry_replenish)
        self.continuation_budget = RetryBudget(
            config.continuation.budget, config.continuation.replenish
        )
        self.breaker = Breaker(
            self.fleet, config.recovery.eject_after, config.recovery.max_ejected_fraction
        )
        self.readmission = Readmission(config, self.fleet, self.client)
        self.journal = Journal(
            Path(config.journal.path) if config.journal.path else None, journal_stamp
        )
        self.recent = RecentCalls()
        self.abandoned = AbandonedHandoffs()
        self.releases = Releases(
            self.client, self.abandoned, config.engine.connect_timeout_s, self.background.spawn
        )
        self.metrics = RouterMetrics(self)
        self.continuation_counts = ContinuationCounts()
        # After its journal line, each request feeds the fleet page, metrics and logs.
        call_hooks: list[CallHook] = [
            self._journal_call,
            self.recent.add,
            self.metrics.observe,
            log_call,
            self.continuation_counts.add,
        ]
        first_token_hooks: list[CallHook] = []
        arrival_hooks: list[Callable[[Call], None]] = []
        self.fleet.listeners += [EngineLines(self.fleet, self.journal.record), log_engine_event]
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
        if config.controller.enabled:
            latency = PhaseLatency()
            call_hooks.append(latency.add)
            first_token_hooks.append(latency.first_token)
            arrival_hooks.append(latency.arrived)
            self.controller = ControlLoop(
                self.fleet,
                self.operations,
                config.controller,
                config.slo,
                latency,
                model_slo={m.name: m.slo for m in config.models if m.slo is not None},
            )
        # Tenants' limits and claims, only with `[[tenants]]`: without, a request pays nothing.
        self.admission: Admission | None = None
        if config.tenants:
            limits = TenantLimits(
                config.tenants, limit_store or LocalStore(), share=config.server.replicas
            )
            self.admission = Admission(
                config.tenants, config.tenants_policy, secrets.tenant_of, limits
            )
            call_hooks.append(self.admission.ended)
            self.operations.reloaded.append(lambda loaded: self._tenants_reloaded(loaded))
        self.outcome = Outcome(
            self.fleet,
            self.breaker,
            self.budget,
            self.continuation_budget,
            failure_quarantine_s=config.recovery.failure_quarantine_s,
        )
        # The Responses route's store, opened on the route's first use.
        self.conversations = Conversations(config.responses, _open_store, self.background.spawn)
        attempt = Attempt(
            config, self.client, self.fleet, self.outcome, self.abandoned, self.releases
        )
        self.requests = RequestPath(
            config,
            self.fleet,
            Retries(attempt, self.outcome),
            self.outcome,
            tracer=self.tracing,
            admission=self.admission,
            conversations=self.conversations,
            call_hooks=[*call_hooks, *hooks.ended],
            first_token_hooks=first_token_hooks,
            arrival_hooks=[*arrival_hooks, *hooks.arrival],
        )

    async def start(self) -> None:
        await self.client.__aenter__()
        self.journal.start()
        spawn = self.background.spawn
        await self.background.start()
        self.metrics.start(spawn)
        self.kv_events.start(spawn)
        spawn(self.readmission.run(), "readmission")
        interval = self.config.engine.metrics_interval_s
        # What each engine serves (its model, its adapters), before the first request.
        served = ServedReader(
            self.fleet, self.client.fetch, self.config.engine.health_timeout_s, interval
        )
        await served.read_all()
        if interval > 0:
            spawn(served.run(), "served-models")
            reports = EngineReports(
                self.fleet, self.client.fetch, interval, self.config.engine.health_timeout_s
            )
            spawn(reports.run(), "engine-reports")
        if self.controller is not None:
            spawn(self.controller.run(), "role-controller")
        if self.discovery is not None:
            self.discovery.start(spawn)

    async def stop(self) -> None:
        """End every background task (releases still under way included: their blocks go
        at the end of the lease), then close the client, the journal and tracing."""
        await self.kv_events.stop()
        await self.background.stop()
        await self.conversations.close()
        await self.client.__aexit__(None, None, None)
        await self.journal.close()
        if self.tracing is not None:
            # Exports what is still batched; it blocks, so off the loop.
            await asyncio.to_thread(self.tracing.shutdown)

    # The request path, as the servers see it ------------------------------------------

    async def handle(self, reply: Reply, endpoint: Endpoint) -> None:
        await self.requests.handle(reply, endpoint)

    async def drain(self, grace_s: float) -> None:
        await self.requests.drain(grace_s)

    @property
    def in_flight(self) -> int:
        return self.requests.in_flight

    @property
    def draining(self) -> bool:
        return self.requests.draining

    def state(self) -> dict[str, Any]:
        """What `/narwhal/state` shows (see `observe.state`)."""
        return snapshot(self)

    def _tenants_reloaded(self, loaded: Config) -> None:
        """A reloaded file's tenants: their bands, weights and limits apply at once."""
        if self.admission is not None:
            self.admission.update(loaded.tenants, loaded.tenants_policy)

    def _journal_call(self, call: Call, now: float) -> None:
        if self.journal.writing:
            self.journal.record(call.entry(now))


async def _open_store(config: ResponsesConfig) -> ConversationStore | None:
    """The conversation store `[responses]` names; its modules (and the Redis client) are
    imported only when the Responses route is first used."""
    from narwhal.conversations.open import open_store

    return await open_store(config)


def _start_tracing(config: Config) -> Tracing | None:
    """Tracing as `[tracing]` and the OTEL_* environment ask for it; None when off.

    The tracing library is imported only here, so a router without tracing never loads it.
    """
    settings = resolve_tracing(config.tracing, process_environment())
    if settings is None:
        return None
    from narwhal.observe.tracing import Tracing

    return Tracing.start(settings, config.model)

"""The parts of a running router that metrics and `/narwhal/state` read, and nothing more."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from narwhal.config.root import Config
from narwhal.config.tenants import TenantConfig, TenantsPolicy
from narwhal.control.loop import ControlLoop
from narwhal.engines.client import EngineClient
from narwhal.engines.kv_events import KvEventFeeds
from narwhal.fleet.discovery import FleetDiscovery
from narwhal.fleet.table import Fleet
from narwhal.observe.recent import RecentCalls
from narwhal.router.abandoned import AbandonedHandoffs
from narwhal.router.budget import RetryBudget
from narwhal.router.continuation import ContinuationCounts


class Observed(Protocol):
    """What the observers read of the router the process built (`app.process.Router`)."""

    @property
    def config(self) -> Config: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def fleet(self) -> Fleet: ...
    @property
    def client(self) -> EngineClient: ...
    @property
    def budget(self) -> RetryBudget: ...
    @property
    def continuation_budget(self) -> RetryBudget: ...
    @property
    def continuation_counts(self) -> ContinuationCounts: ...
    @property
    def recent(self) -> RecentCalls: ...
    @property
    def abandoned(self) -> AbandonedHandoffs: ...
    @property
    def controller(self) -> ControlLoop | None: ...
    @property
    def discovery(self) -> FleetDiscovery | None: ...
    @property
    def kv_events(self) -> KvEventFeeds: ...
    # Tenants' admission; None without `[[tenants]]`.
    @property
    def admission(self) -> AdmissionSeen | None: ...


class TenantLimitsSeen(Protocol):
    """What the observers read of tenants' limits (`tenants.limits.TenantLimits`)."""

    def state(self, now: float) -> dict[str, Any]: ...


class AdmissionSeen(Protocol):
    """What the observers read of tenants' admission (`router.admission.Admission`): each
    tenant's settings, the policy, and the limits' state (on `time.monotonic()`)."""

    @property
    def tenants(self) -> Mapping[str, TenantConfig]: ...
    @property
    def policy(self) -> TenantsPolicy: ...
    @property
    def limits(self) -> TenantLimitsSeen: ...

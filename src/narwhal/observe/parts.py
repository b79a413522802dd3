"""The parts of a running router that metrics and `/narwhal/state` read, and nothing more."""

from __future__ import annotations

from typing import Protocol

from narwhal.config.root import Config
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

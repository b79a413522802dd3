"""What the client-facing servers need of the router behind them, and nothing more."""

from __future__ import annotations

from typing import Any, Protocol

from narwhal.config.root import Config
from narwhal.fleet.operations import FleetOperations
from narwhal.fleet.table import Fleet
from narwhal.observe.metrics import RouterMetrics
from narwhal.protocol.bodies import Endpoint
from narwhal.router.abandoned import AbandonedHandoffs
from narwhal.router.admission import Admission
from narwhal.router.reply import Reply
from narwhal.router.responses import Conversations


class Served(Protocol):
    """The router the process built (`app.process.Router`), as the servers see it."""

    @property
    def config(self) -> Config: ...
    @property
    def draining(self) -> bool: ...
    @property
    def fleet(self) -> Fleet: ...
    @property
    def metrics(self) -> RouterMetrics: ...
    @property
    def operations(self) -> FleetOperations: ...
    @property
    def abandoned(self) -> AbandonedHandoffs: ...
    @property
    def admission(self) -> Admission | None: ...
    @property
    def conversations(self) -> Conversations: ...

    async def handle(self, reply: Reply, endpoint: Endpoint) -> None:
        """Serve one client request to its one outcome."""
        ...

    def state(self) -> dict[str, Any]:
        """What `/narwhal/state` shows."""
        ...

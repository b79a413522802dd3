"""Releases of abandoned handoffs, in the background: the request that dropped a
descriptor does not wait for its release, and the router waits for none at shutdown."""

from __future__ import annotations

from narwhal.engines.client import EngineClient
from narwhal.engines.connector import PrefillResult
from narwhal.engines.release import release_handoff
from narwhal.protocol.errors import NarwhalError
from narwhal.router.abandoned import AbandonedHandoffs, Abandonment
from narwhal.runtime.background import Spawn


class Releases:
    """Asks consumers to free abandoned handoffs' blocks; each outcome goes to `abandoned`."""

    def __init__(
        self, client: EngineClient, abandoned: AbandonedHandoffs, timeout_s: float, spawn: Spawn
    ) -> None:
        """`spawn` starts each release in the router's background, which cancels those
        still under way when the router stops: their blocks go at the end of the lease."""
        self.client = client
        self.abandoned = abandoned
        self.timeout_s = timeout_s
        self.spawn = spawn

    def start(self, consumer_url: str, result: PrefillResult, lost: Abandonment) -> None:
        self.spawn(self._release(consumer_url, result, lost), f"release-{result.request_id}")

    async def _release(self, consumer_url: str, result: PrefillResult, lost: Abandonment) -> None:
        # Only a descriptor that passes every handoff rule goes to a consumer: a malformed
        # one, or one naming another host, is never handed on, not even to be released.
        try:
            descriptor = await self.client.handoff_descriptor(consumer_url, result.endpoint, result)
        except NarwhalError:
            descriptor = None
        freed = descriptor is not None and await release_handoff(
            self.client, consumer_url, result.request_id, descriptor, self.timeout_s
        )
        self.abandoned.released(lost, freed)

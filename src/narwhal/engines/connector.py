"""What a prefill hands to its decode: the producer, the route, the backend id, the descriptor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

NIXL_CONNECTOR = "NixlConnector"


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """One producer handoff.

    `descriptor` holds the producer's `kv_transfer_params` exactly as it sent them (raw
    JSON), or None when it sent `null`, omitted them, or was not asked to hold blocks
    (a same-worker prefill). Handoff age counts from `started_at` (event-loop time).
    """

    producer_url: str
    endpoint: str
    request_id: str
    descriptor: bytes | None
    started_at: float
    prompt_tokens: int | None = None
    connector: str = NIXL_CONNECTOR
    same_worker: bool = False
    # Hosts besides the producer's own that its descriptor may send consumers to.
    kv_hosts: tuple[str, ...] = ()
    # The producer's name in errors (its engine id when the router knows it).
    producer: str = ""

    def parameters(self) -> Any:
        """A detached copy of the descriptor; changing it changes nothing here."""
        if self.descriptor is None:
            return None
        return orjson.loads(self.descriptor)

    def age(self, now: float) -> float:
        return now - self.started_at


@dataclass(slots=True)
class Delivery:
    """Whether a decode carried its descriptor to the consumer.

    `written` once the request's bytes went out; `refused` when the consumer answered
    something other than 200, which vLLM does before the request reaches its engine. A
    descriptor written and not refused may have been pulled, whatever happens next; one
    never written, or refused, leaves the producer's blocks held.
    """

    written: bool = False
    refused: bool = False

    def sent(self) -> None:
        self.written = True

    @property
    def delivered(self) -> bool:
        return self.written and not self.refused

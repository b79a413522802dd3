"""What one stored response is, and what every conversation store does with it.

A response is kept with its own turn's input and the ids of the responses before it, so that
a follow-up's whole conversation is read back with two lookups, whatever its length, and no
turn's input is stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response as the router answered it, and what it needs to continue from it."""

    id: str
    # The tenant whose client created it (None without tenants): only that tenant sees it.
    tenant: str | None
    model: str
    # Unix seconds.
    created_at: float
    previous_id: str | None
    # The ids of the earlier responses of its conversation, oldest first (the last is
    # `previous_id`); empty for a conversation's first response.
    ancestors: tuple[str, ...]
    # A JSON array: this turn's own input items, as the router normalized them.
    input: bytes
    # A JSON object: the response as the client got it (its `output` items, `usage`, ...).
    response: bytes


class NotStored(LookupError):
    """A conversation names a response the store does not hold (or holds for another
    tenant): `response_id` is the first one missing."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class StoreUnavailable(RuntimeError):
    """The configured store cannot be opened (its file, or its Redis server); the message
    names which."""


class ConversationStore(Protocol):
    """Where stored responses live (`conversations.sqlite`, `conversations.redis`).

    Every method is safe to call from several tasks, and from several processes sharing
    the store. A response another tenant stored is as absent as one never stored.
    Retention (`max_stored`, `max_age_s`) is the store's own: an expired response is absent
    even before it is removed.
    """

    async def put(self, record: StoredResponse) -> None:
        """Keep `record` (replacing one of the same id)."""
        ...

    async def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The response, or None."""
        ...

    async def conversation(self, response_id: str, tenant: str | None) -> list[StoredResponse]:
        """The response and every response before it, oldest first. Raises `NotStored`
        naming the first id that is absent (`response_id` itself, or an ancestor)."""
        ...

    async def delete(self, response_id: str, tenant: str | None) -> bool:
        """Remove the response; whether there was one to remove."""
        ...

    async def prune(self) -> int:
        """Apply retention now; how many responses were removed."""
        ...

    async def close(self) -> None: ...

"""A real Redis server for the Redis store's tests, each store kind opened the same way, and
records to store."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import orjson
import pytest

from narwhal.conversations.record import ConversationStore, StoredResponse
from narwhal.conversations.redis import RedisStore
from narwhal.conversations.sqlite import SqliteStore
from support.redis_server import start_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a redis-server of this machine, started for the session (no persistence)."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def prefix() -> str:
    """Keys of this test's own, on the session's server."""
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def now() -> list[float]:
    """The injected clock's time, in a list so that a test moves it."""
    return [1000.0]


@pytest.fixture
def clock(now: list[float]) -> Callable[[], float]:
    return lambda: now[0]


StoreFactory = Callable[..., Awaitable[ConversationStore]]


@pytest.fixture(params=["sqlite", "redis"])
async def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, prefix: str, clock: Callable[[], float]
) -> AsyncIterator[StoreFactory]:
    """`await make_store(max_stored=..., max_age_s=...)`: a store of each kind in turn (all
    of one test share the file or the key prefix), on the injected clock; closed after."""
    url: str | None = request.getfixturevalue("redis_url") if request.param == "redis" else None
    opened: list[ConversationStore] = []

    async def make(*, max_stored: int = 1000, max_age_s: float = 3600.0) -> ConversationStore:
        store: ConversationStore
        if url is None:
            path = tmp_path / "responses.sqlite3"
            store = SqliteStore(path, max_stored=max_stored, max_age_s=max_age_s, clock=clock)
        else:
            store = await RedisStore.connect(
                url, max_stored=max_stored, max_age_s=max_age_s, prefix=prefix, clock=clock
            )
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


Turn = Callable[..., StoredResponse]


@pytest.fixture
def turn() -> Turn:
    """`turn(id, after=earlier, tenant=..., created_at=...)`: a response continuing `after`
    (or a conversation's first), with its own input and response bytes."""

    def make(
        response_id: str,
        after: StoredResponse | None = None,
        *,
        tenant: str | None = None,
        created_at: float = 1000.0,
        model: str = "narwhal-sim",
    ) -> StoredResponse:
        ancestors = (*after.ancestors, after.id) if after else ()
        # Pretty-printed, so that the bytes hold newlines (the Redis store frames on one).
        question = [{"role": "user", "content": f"question of {response_id} — é\n"}]
        answer = {"id": response_id, "output": [{"type": "message", "text": f"answer {ancestors}"}]}
        return StoredResponse(
            id=response_id,
            tenant=tenant,
            model=model,
            created_at=created_at,
            previous_id=after.id if after else None,
            ancestors=ancestors,
            input=orjson.dumps(question, option=orjson.OPT_INDENT_2),
            response=orjson.dumps(answer, option=orjson.OPT_INDENT_2),
        )

    return make


Chain = Callable[..., list[StoredResponse]]


@pytest.fixture
def chain(turn: Turn) -> Chain:
    """`chain(n, name="resp", tenant=..., created_at=...)`: one conversation of `n` responses,
    `{name}_0` first, oldest first."""

    def make(length: int, name: str = "resp", **fields: object) -> list[StoredResponse]:
        records: list[StoredResponse] = []
        for index in range(length):
            records.append(turn(f"{name}_{index}", records[-1] if records else None, **fields))
        return records

    return make

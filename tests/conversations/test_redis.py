"""The Redis store on a real redis-server: one key per response with a time to live, the ids
by creation time trimmed on every put, and several clients sharing them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from narwhal.conversations.record import NotStored, StoredResponse
from narwhal.conversations.redis import RedisStore

Turn = Callable[..., StoredResponse]
Chain = Callable[..., list[StoredResponse]]


@pytest.fixture
async def server(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client, to look at the keys themselves."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def store(
    redis_url: str, prefix: str, clock: Callable[[], float]
) -> AsyncIterator[RedisStore]:
    opened = await RedisStore.connect(
        redis_url, max_stored=3, max_age_s=60.0, prefix=prefix, clock=clock
    )
    yield opened
    await opened.close()


async def test_a_response_is_one_key_living_as_long_as_its_age_allows(
    store: RedisStore, server: aioredis.Redis, prefix: str, turn: Turn, now: list[float]
) -> None:
    now[0] = 1020.0
    await store.put(turn("resp_a", created_at=1000.0))
    key = f"{prefix}resp:resp_a"
    assert await server.type(key) == b"string"
    # 40 s of its 60 remain; the server's own clock has run a little since.
    assert 30_000 < await server.pttl(key) <= 40_000
    assert await server.zrange(f"{prefix}resp-order", 0, -1, withscores=True) == [
        (b"resp_a", 1000.0)
    ]
    assert set(await server.keys(f"{prefix}*")) == {key.encode(), f"{prefix}resp-order".encode()}


async def test_the_server_removes_a_key_when_its_time_is_up(
    redis_url: str, prefix: str, server: aioredis.Redis, turn: Turn
) -> None:
    store = await RedisStore.connect(redis_url, max_stored=3, max_age_s=0.2, prefix=prefix)
    try:
        await store.put(turn("resp_a", created_at=time.time()))
        key = f"{prefix}resp:resp_a"
        # Up to 30 s: the server expires keys on its own schedule.
        for _ in range(600):
            if not await server.exists(key):
                break
            await asyncio.sleep(0.05)
        assert not await server.exists(key)
    finally:
        await store.close()


async def test_each_put_trims_the_oldest_beyond_max_stored_and_deletes_their_keys(
    store: RedisStore, server: aioredis.Redis, prefix: str, turn: Turn
) -> None:
    for index in range(5):
        await store.put(turn(f"resp_{index}", created_at=1000.0 + index))
    assert await server.zrange(f"{prefix}resp-order", 0, -1) == [b"resp_2", b"resp_3", b"resp_4"]
    for index in range(5):
        assert await server.exists(f"{prefix}resp:resp_{index}") == (index >= 2)
    assert await store.prune() == 0


async def test_each_put_and_prune_drop_the_expired(
    store: RedisStore, server: aioredis.Redis, prefix: str, turn: Turn, now: list[float]
) -> None:
    await store.put(turn("resp_old", created_at=1000.0))
    await store.put(turn("resp_older", created_at=990.0))
    now[0] = 1055.0
    await store.put(turn("resp_new", created_at=1055.0))
    # resp_older was 65 s old at that put: gone with its key; resp_old, 55 s, stays.
    order = f"{prefix}resp-order"
    assert await server.zrange(order, 0, -1) == [b"resp_old", b"resp_new"]
    assert not await server.exists(f"{prefix}resp:resp_older")
    now[0] = 1061.0
    assert await store.prune() == 1
    assert await server.zrange(order, 0, -1) == [b"resp_new"]
    assert not await server.exists(f"{prefix}resp:resp_old")


async def test_two_clients_share_the_responses(
    redis_url: str, prefix: str, chain: Chain, clock: Callable[[], float]
) -> None:
    first, second = [
        await RedisStore.connect(
            redis_url, max_stored=100, max_age_s=60.0, prefix=prefix, clock=clock
        )
        for _ in range(2)
    ]
    try:
        records = chain(4, tenant="acme")
        await first.put(records[0])
        await second.put(records[1])
        await first.put(records[2])
        await second.put(records[3])
        assert await first.conversation("resp_3", "acme") == records
        assert await second.conversation("resp_3", "acme") == records
        assert await second.delete("resp_1", "acme")
        with pytest.raises(NotStored) as missing:
            await first.conversation("resp_3", "acme")
        assert missing.value.response_id == "resp_1"
    finally:
        await first.close()
        await second.close()


async def test_stores_of_other_prefixes_do_not_meet(
    redis_url: str, prefix: str, turn: Turn, clock: Callable[[], float]
) -> None:
    ours, theirs = [
        await RedisStore.connect(redis_url, max_stored=1, max_age_s=60.0, prefix=name, clock=clock)
        for name in (prefix, prefix + "other:")
    ]
    try:
        await ours.put(turn("resp_a"))
        await theirs.put(turn("resp_b"))
        # Each keeps its one response: the other's put trimmed nothing of its own.
        assert await ours.get("resp_a", None) == turn("resp_a")
        assert await ours.get("resp_b", None) is None
        assert await theirs.get("resp_b", None) == turn("resp_b")
        assert await theirs.get("resp_a", None) is None
    finally:
        await ours.close()
        await theirs.close()


async def test_a_client_that_decodes_answers_is_refused(
    redis_url: str, prefix: str, turn: Turn
) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    store = RedisStore(client, max_stored=10, max_age_s=60.0, prefix=prefix)
    try:
        await store.put(turn("resp_a", created_at=time.time()))
        with pytest.raises(TypeError):
            await store.get("resp_a", None)
    finally:
        await store.close()

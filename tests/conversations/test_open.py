"""Opening the store `[responses]` names, and saying which one could not be opened."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from narwhal.config.responses import ResponsesConfig, StoreKind
from narwhal.conversations.open import open_store, shown_url
from narwhal.conversations.record import StoredResponse, StoreUnavailable
from narwhal.conversations.redis import RedisStore
from narwhal.conversations.sqlite import SqliteStore

Turn = Callable[..., StoredResponse]


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_off_opens_nothing() -> None:
    assert await open_store(ResponsesConfig(store=StoreKind.OFF)) is None


async def test_sqlite_opens_the_configured_file(tmp_path: Path, turn: Turn) -> None:
    path = tmp_path / "var" / "responses.sqlite3"
    store = await open_store(ResponsesConfig(path=str(path), max_stored=5, max_age_s=1e12))
    assert isinstance(store, SqliteStore)
    try:
        await store.put(turn("resp_a"))
        assert await store.get("resp_a", None) == turn("resp_a")
    finally:
        await store.close()
    assert path.is_file()


async def test_an_unusable_path_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    path = blocker / "responses.sqlite3"
    with pytest.raises(StoreUnavailable, match=str(path)):
        await open_store(ResponsesConfig(path=str(path)))
    with pytest.raises(StoreUnavailable, match=str(blocker)):
        await open_store(ResponsesConfig(path=str(blocker)))


async def test_redis_opens_the_configured_server(redis_url: str) -> None:
    config = ResponsesConfig(store=StoreKind.REDIS, redis_url=redis_url)
    store = await open_store(config)
    assert isinstance(store, RedisStore)
    await store.close()


async def test_a_redis_server_that_does_not_answer_is_named_without_its_password() -> None:
    url = f"redis://narwhal:s3cret@127.0.0.1:{unused_port()}/0"
    config = ResponsesConfig(store=StoreKind.REDIS, redis_url=url)
    with pytest.raises(StoreUnavailable) as failed:
        await open_store(config)
    assert f"redis://narwhal:***@127.0.0.1:{url.rsplit(':', 1)[1]}" in str(failed.value)
    assert "s3cret" not in str(failed.value)


def test_a_url_is_shown_without_its_password() -> None:
    assert shown_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert shown_url("rediss://:pw@cache:6380") == "rediss://:***@cache:6380"
    assert shown_url("redis://user:pw@cache/1?x=1") == "redis://user:***@cache/1?x=1"

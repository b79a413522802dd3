"""The store `[responses]` configures, opened once at startup."""

from __future__ import annotations

import sqlite3
from urllib.parse import urlsplit, urlunsplit

from narwhal.config.responses import ResponsesConfig, StoreKind
from narwhal.conversations.record import ConversationStore, StoreUnavailable


async def open_store(config: ResponsesConfig) -> ConversationStore | None:
    """The configured store, or None when `store = "off"`. Raises `StoreUnavailable`, naming
    the file or the server, when it cannot be opened (an unwritable path, a Redis server
    that does not answer)."""
    if config.store is StoreKind.OFF:
        return None
    if config.store is StoreKind.SQLITE:
        from narwhal.conversations.sqlite import SqliteStore

        try:
            return SqliteStore(
                config.path, max_stored=config.max_stored, max_age_s=config.max_age_s
            )
        except (OSError, sqlite3.Error) as error:
            raise StoreUnavailable(
                f"cannot open the responses store {config.path}: {error}"
            ) from error
    from redis.exceptions import RedisError

    from narwhal.conversations.redis import RedisStore

    if config.redis_url is None:
        raise StoreUnavailable('store = "redis" needs a redis_url')
    try:
        return await RedisStore.connect(
            config.redis_url, max_stored=config.max_stored, max_age_s=config.max_age_s
        )
    except (OSError, RedisError, ValueError) as error:
        raise StoreUnavailable(
            f"cannot reach the responses store's Redis at {shown_url(config.redis_url)}: {error}"
        ) from error


def shown_url(url: str) -> str:
    """`url` without its password, to be named in a message."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))

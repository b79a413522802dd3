"""`[responses]`: where the router keeps the Responses API's stored responses.

Read with the rest of the configuration, so that `narwhal config validate` names a bad key
by its path. The store itself is `narwhal.conversations`; the route is the request path's.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from narwhal.config.table import Table


class StoreKind(enum.StrEnum):
    """Where stored responses live."""

    SQLITE = "sqlite"
    REDIS = "redis"
    OFF = "off"


_REDIS_URL = re.compile(r"(redis|rediss|unix)://\S+")


@dataclass(frozen=True, slots=True)
class ResponsesConfig:
    """`[responses]` with its defaults (see docs/responses.md)."""

    # "sqlite": one file, in WAL mode, shared by the workers of one host and kept across
    # restarts; "redis": a Redis server, shared by workers and replicas; "off": nothing is
    # kept (a request asking to store is answered, and a follow-up by id is a 404).
    store: StoreKind = StoreKind.SQLITE
    # The SQLite file, relative to the working directory unless absolute.
    path: str = "narwhal-responses.sqlite3"
    redis_url: str | None = None
    # Retention: at most this many responses, none older than this. The oldest go first.
    max_stored: int = 100_000
    max_age_s: float = 30 * 86400.0


def parse_responses(table: Table) -> ResponsesConfig:
    """Read `[responses]`, recording each bad key's problem under its path."""
    d = ResponsesConfig()
    store = table.choice("store", StoreKind, d.store)
    config = ResponsesConfig(
        store=store,
        path=table.string("path", d.path),
        redis_url=table.string(
            "redis_url", "", pattern=_REDIS_URL, wanted="a redis://, rediss:// or unix:// URL"
        )
        or None,
        max_stored=table.integer("max_stored", d.max_stored, 1),
        max_age_s=table.number("max_age_s", d.max_age_s),
    )
    if store is StoreKind.REDIS and config.redis_url is None and not table.failed():
        table.fail("redis_url", 'is required with store = "redis"')
    table.close()
    return config

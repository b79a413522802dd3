"""`[responses]`: where stored responses are kept, and for how long."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config.responses import ResponsesConfig, StoreKind
from narwhal.config.root import ConfigError, parse_config

ENGINES = [
    {"id": "p0", "url": "http://10.0.0.1:1", "role": "prefill"},
    {"id": "d0", "url": "http://10.0.0.2:1", "role": "decode"},
]


def fleet(**responses: Any) -> dict[str, Any]:
    return {"model": "m", "engines": ENGINES, "responses": responses}


def problems(data: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return caught.value.problems


def test_the_default_is_a_sqlite_file_for_30_days_and_100k_responses() -> None:
    config = parse_config({"model": "m", "engines": ENGINES}).responses
    assert config == ResponsesConfig()
    assert config.store is StoreKind.SQLITE
    assert config.path == "narwhal-responses.sqlite3"
    assert (config.max_stored, config.max_age_s) == (100_000, 30 * 86400.0)


def test_every_key_is_read() -> None:
    config = parse_config(
        fleet(
            store="redis",
            path="/var/lib/narwhal/r.db",
            redis_url="redis://10.0.0.9:6379/2",
            max_stored=5000,
            max_age_s=3600,
        )
    ).responses
    assert config == ResponsesConfig(
        StoreKind.REDIS, "/var/lib/narwhal/r.db", "redis://10.0.0.9:6379/2", 5000, 3600.0
    )
    assert parse_config(fleet(store="off")).responses.store is StoreKind.OFF


def test_redis_needs_its_url() -> None:
    assert problems(fleet(store="redis")) == (
        'responses.redis_url: is required with store = "redis"',
    )


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        (
            "store",
            "memory",
            'responses.store: must be one of "sqlite", "redis", "off", got "memory"',
        ),
        (
            "redis_url",
            "http://cache:6379",
            "responses.redis_url: must be a redis://, rediss:// or unix:// URL, "
            'got "http://cache:6379"',
        ),
        ("max_stored", 0, "responses.max_stored: must be an integer >= 1, got 0"),
        ("max_age_s", -1, "responses.max_age_s: must be a number > 0, got -1"),
        ("path", "", 'responses.path: must be a non-empty string, got ""'),
    ],
)
def test_a_bad_value_is_named_by_its_path(key: str, value: object, problem: str) -> None:
    assert problems(fleet(**{key: value})) == (problem,)


def test_an_unknown_key_is_refused() -> None:
    (problem,) = problems(fleet(keep=True))
    assert problem.startswith("responses.keep:")

"""`[placement]`: the policy, its bound and index, and the engines' KV event endpoints."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config.placement import PlacementConfig, Policy
from narwhal.config.root import ConfigError, parse_config

ENGINES = [
    {"id": "p0", "url": "http://10.0.0.1:1", "role": "prefill"},
    {"id": "d0", "url": "http://10.0.0.2:1", "role": "decode"},
]


def fleet(**placement: Any) -> dict[str, Any]:
    return {"model": "m", "engines": ENGINES, "placement": placement}


def problems(data: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return caught.value.problems


def test_prefix_placement_is_the_default() -> None:
    config = parse_config({"model": "m", "engines": ENGINES})
    assert config.placement == PlacementConfig()
    assert config.placement.policy is Policy.PREFIX
    assert config.placement.kv_events == {}


def test_keys_are_read() -> None:
    config = parse_config(
        fleet(
            policy="p2c",
            load_slack=0.5,
            load_window=10,
            chunk_chars=32,
            index_chunks=100,
            min_chunks=1,
            chars_per_token=3.5,
            kv_events={"p0": "tcp://10.0.0.1:5557"},
        )
    )
    assert config.placement == PlacementConfig(
        Policy.P2C, 0.5, 10, 32, 100, 1, 3.5, {"p0": "tcp://10.0.0.1:5557"}
    )


def test_bad_keys_are_named_by_path() -> None:
    assert problems(
        fleet(policy="random", chunk_chars=0, load_slack=-1, kv_events={"p0": "10.0.0.1:5557"})
    ) == (
        'placement.policy: must be one of "prefix", "p2c", "session", got "random"',
        "placement.load_slack: must be a number >= 0, got -1",
        "placement.chunk_chars: must be an integer >= 1, got 0",
        'placement.kv_events.p0: must be a ZMQ endpoint like tcp://HOST:PORT, got "10.0.0.1:5557"',
    )


def test_kv_events_must_name_a_configured_engine() -> None:
    assert problems(fleet(kv_events={"p9": "tcp://10.0.0.1:5557"})) == (
        "placement.kv_events.p9: names no engine in [[engines]]",
    )

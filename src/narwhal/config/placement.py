"""`[placement]`: how the router chooses a producer and a consumer among those with a seat.

Read with the rest of the configuration, so that `narwhal config validate` names a bad key
by its path. The decisions themselves are `narwhal.fleet.placement` and
`narwhal.fleet.prefix_index`; the engines' own cache events are read by
`narwhal.engines.kv_events`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from narwhal.config.table import Table, show


class Policy(StrEnum):
    # Expected cached prefix against load, within a load bound (the default: measured in
    # docs/operations.md, "Cache-aware placement").
    PREFIX = "prefix"
    # Power of two choices over the load estimate alone.
    P2C = "p2c"
    # A consistent hash of the request's `user` (else its first chunk), no load bound.
    SESSION = "session"


_ENDPOINT = re.compile(r"(tcp|ipc)://\S+")


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """`[placement]` with its defaults (see docs/operations.md, "Cache-aware placement")."""

    policy: Policy = Policy.PREFIX
    # An engine may take a request while its share of the recent placements is at most
    # (1 + load_slack) times an even share (bounded-load consistent hashing's c).
    load_slack: float = 0.15
    # Placements per phase that the load bound counts ("recent").
    load_window: int = 64
    # Prompt characters per chunk: the unit of the router's prefix index.
    chunk_chars: int = 64
    # Chunks the index remembers per engine (least recently used forgotten first).
    index_chunks: int = 65_536
    # A match shorter than this many chunks is not worth steering for: load decides.
    min_chunks: int = 2
    # Characters per token, to map an engine's evicted blocks onto the index's chunks.
    chars_per_token: float = 4.0
    # Engine id -> the ZMQ endpoint its KV events are read from (vLLM `--kv-events-config`).
    kv_events: Mapping[str, str] = field(default_factory=dict)


def parse_placement(table: Table) -> PlacementConfig:
    """Read `[placement]`, recording each bad key's problem under its path."""
    d = PlacementConfig()
    config = PlacementConfig(
        policy=table.choice("policy", Policy, d.policy),
        load_slack=table.number("load_slack", d.load_slack, zero_ok=True),
        load_window=table.integer("load_window", d.load_window, 1),
        chunk_chars=table.integer("chunk_chars", d.chunk_chars, 1),
        index_chunks=table.integer("index_chunks", d.index_chunks, 1),
        min_chunks=table.integer("min_chunks", d.min_chunks, 1),
        chars_per_token=table.number("chars_per_token", d.chars_per_token),
        kv_events=_endpoints(table.table("kv_events")),
    )
    table.close()
    return config


def _endpoints(table: Table) -> dict[str, str]:
    endpoints: dict[str, str] = {}
    for engine, value in table.rest().items():
        if isinstance(value, str) and _ENDPOINT.fullmatch(value):
            endpoints[engine] = value
        else:
            table.fail(engine, f"must be a ZMQ endpoint like tcp://HOST:PORT, got {show(value)}")
    return endpoints

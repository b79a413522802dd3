"""Fleet files for configuration tests: the smallest valid one, a key set on it, and the
problems the parser finds."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from narwhal.config.root import ConfigError, parse_config

MINIMAL: dict[str, Any] = {
    "model": "m",
    "engines": [
        {"id": "p0", "url": "http://10.0.0.1:8100", "role": "prefill"},
        {"id": "d0", "url": "http://10.0.0.2:8100", "role": "decode"},
    ],
}

SECTIONS = ("server", "engine", "serving", "recovery", "journal")


def with_value(path: str, value: object, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of the minimal fleet (or `base`) with the key at `path` set to `value`."""
    data = copy.deepcopy(MINIMAL if base is None else base)
    *parents, last = path.split(".")
    node = data
    for part in parents:
        name, _, index = part.partition("[")
        node = node.setdefault(name, {})
        if index:
            node = node[int(index.rstrip("]"))]
    node[last] = value
    return data


def problems(data: object) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)  # type: ignore[arg-type]
    return caught.value.problems


def problem(data: object) -> str:
    (only,) = problems(data)
    return only


# Keys by type, for the type rules (and fleets drawn at random).
INT_PATHS = [
    "server.port",
    "serving.max_attempts",
    "serving.retry_budget",
    "serving.max_request_bytes",
    "serving.queue_capacity",
    "recovery.eject_after",
    "engines[0].max_prefill_seats",
    "engines[1].max_decode_seats",
    "engine_contract.block_size",
    "engine_contract.tp_size",
]

FLOAT_PATHS = [
    "server.graceful_timeout_s",
    "server.client_timeout_s",
    "engine.first_token_timeout_s",
    "engine.decode_read_timeout_s",
    "engine.prefill_timeout_s",
    "engine.connect_timeout_s",
    "engine.health_timeout_s",
    "engine.kv_lease_s",
    "serving.request_timeout_s",
    "serving.retry_replenish",
    "serving.queue_timeout_s",
    "recovery.readmit_interval_s",
    "recovery.failure_quarantine_s",
]

STRING_PATHS = [
    "model",
    "server.host",
    "engine.ca_bundle",
    "journal.path",
    "engine_contract.engine_version",
    "engine_contract.model",
    "engine_contract.connector",
    "engines[0].url",
    "engines[0].identity_url",
]

CONTRACT = {
    "engine_version": "0.11.0",
    "model": "m",
    "connector": "NixlConnector",
    "block_size": 16,
    "tp_size": 1,
}

"""Any valid fleet, drawn at random: accepted with each value it gives, from TOML and JSON
alike, and refused once a boolean stands for an integer."""

from __future__ import annotations

import json
import re
import string
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.root import (
    Config,
    ConfigError,
    load_config,
    parse_config,
)
from support.configs import (
    CONTRACT,
    FLOAT_PATHS,
    INT_PATHS,
    SECTIONS,
    STRING_PATHS,
    problems,
    with_value,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"


# --- Any valid fleet -----------------------------------------------------------------------

names = st.text(string.ascii_letters + string.digits + "._-", min_size=1, max_size=16)
texts = st.text(min_size=1, max_size=20)
short = st.one_of(st.integers(1, 100), st.floats(0.001, 100))
short_or_zero = st.one_of(st.integers(0, 100), st.floats(0, 100))
long = st.one_of(st.integers(200, 10**6), st.floats(200, 10**6))


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, Any]:
    """Valid fleet mappings: any subset of keys, values in range, cross-field rules kept."""

    def section(**keys: st.SearchStrategy[Any]) -> dict[str, Any]:
        return draw(st.fixed_dictionaries({}, optional=keys))

    model = draw(texts)
    data: dict[str, Any] = {"model": model}
    data["server"] = section(
        host=st.sampled_from(["127.0.0.1", "0.0.0.0", "router.internal"]),
        port=st.integers(0, 65535),
        graceful_timeout_s=short_or_zero,
        client_timeout_s=short,
        api_keys=st.lists(texts, max_size=3),
        admin_api_keys=st.lists(texts, max_size=3),
    )
    data["engine"] = section(
        first_token_timeout_s=short,
        decode_read_timeout_s=short_or_zero,
        prefill_timeout_s=short,
        connect_timeout_s=long,
        health_timeout_s=long,
        kv_lease_s=long,
        api_key_env=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
        ca_bundle=texts,
    )
    data["serving"] = section(
        request_timeout_s=long,
        max_attempts=st.integers(1, 10),
        retry_budget=st.integers(0, 10**6),
        retry_replenish=short_or_zero,
        max_request_bytes=st.integers(1, 2**40),
        queue_capacity=st.integers(0, 10**6),
        queue_timeout_s=short,
    )
    data["recovery"] = section(
        eject_after=st.integers(1, 100),
        readmit_interval_s=long,
        failure_quarantine_s=short_or_zero,
        restart_policy=st.sampled_from(["individual", "whole_wave"]),
    )
    data["journal"] = section(path=texts)
    if draw(st.booleans()):
        extra = st.one_of(texts, st.integers(), st.floats(allow_nan=False, allow_infinity=False))
        data["engine_contract"] = {
            **draw(st.dictionaries(st.sampled_from(["dtype", "quant", "x"]), extra)),
            **{**CONTRACT, "model": model},
        }
    roles = draw(st.lists(st.sampled_from(["prefill", "decode", "both"]), min_size=1, max_size=6))
    if not any(role != "decode" for role in roles):
        roles[0] = "both"
    if not any(role != "prefill" for role in roles):
        roles[-1] = "both"
    ids = draw(st.lists(names, min_size=len(roles), max_size=len(roles), unique=True))
    data["engines"] = [
        {
            "id": engine_id,
            "url": draw(st.sampled_from(["http", "https"]))
            + f"://10.0.0.{index + 1}:{draw(st.integers(1, 65535))}"
            + draw(st.sampled_from(["", "/"])),
            "role": role,
            **section(
                max_prefill_seats=st.integers(0, 1024),
                max_decode_seats=st.integers(0, 1024),
                identity_url=st.just(f"http://10.0.0.{index + 1}:9100/identity"),
                kv_hosts=st.lists(st.sampled_from(["10.1.0.1", "gpu-1.kv", "fd00::1"])),
            ),
        }
        for index, (engine_id, role) in enumerate(zip(ids, roles, strict=True))
    ]
    return data


def expected(value: object) -> object:
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, str) and re.fullmatch(r"https?://10\.0\.0\.\d+:\d+/", value):
        return value[:-1]
    return value


@given(fleets())
def test_any_valid_fleet_is_accepted_carrying_each_value_given(data: dict[str, Any]) -> None:
    config = parse_config(data)
    assert config.model == data["model"]
    for name in SECTIONS:
        for key, value in data[name].items():
            assert getattr(getattr(config, name), key) == expected(value), f"{name}.{key}"
    for spec, entry in zip(config.engines, data["engines"], strict=True):
        for key, value in entry.items():
            assert getattr(spec, key) == expected(value), f"engines.{key}"
    if "engine_contract" in data:
        contract = config.engine_contract
        assert contract is not None
        pinned = {key: getattr(contract, key) for key in CONTRACT}
        assert pinned | dict(contract.extra) == data["engine_contract"]


@given(fleets())
def test_any_valid_fleet_reads_the_same_from_a_json_file(data: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fleet.json"
        path.write_text(json.dumps(data))
        assert load_config(path) == parse_config(data)


@given(fleets(), st.sampled_from(INT_PATHS[:6]), st.booleans())
def test_any_valid_fleet_with_a_boolean_for_an_integer_is_refused(
    data: dict[str, Any], path: str, value: bool
) -> None:
    found = problems(with_value(path, value, data))
    assert any(p.startswith(f"{path}: must be an integer") for p in found)


def test_a_config_built_directly_uses_the_same_defaults() -> None:
    spec = EngineSpec("b0", "http://10.0.0.1:1", Role.BOTH)
    assert Config("m", (spec,)) == parse_config(
        {"model": "m", "engines": [{"id": "b0", "url": "http://10.0.0.1:1", "role": "both"}]}
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@given(
    fleets(),
    st.sampled_from([*INT_PATHS[:6], *FLOAT_PATHS, *STRING_PATHS, "engines[0].role", "server"]),
    json_values,
)
def test_any_value_anywhere_gives_a_config_or_a_config_error(
    data: dict[str, Any], path: str, value: object
) -> None:
    try:
        parse_config(with_value(path, value, data))
    except ConfigError as error:
        assert error.problems
        assert all(": " in problem for problem in error.problems)

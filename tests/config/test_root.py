"""The fleet file: defaults, strict types and ranges, unknown keys, cross-field rules, reports."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import string
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.config.controller import ControllerConfig, SloConfig
from narwhal.config.engine_spec import ContractValue, EngineContract, EngineSpec, Role
from narwhal.config.placement import PlacementConfig
from narwhal.config.report import validate_command
from narwhal.config.root import (
    Config,
    ConfigError,
    EngineConfig,
    JournalConfig,
    NonstreamDecode,
    RecoveryConfig,
    RestartPolicy,
    ServerConfig,
    ServingConfig,
    load_config,
    parse_config,
)
from narwhal.config.tracing import TracingConfig

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"

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


# --- Defaults and sources ------------------------------------------------------------------


def test_sections_left_out_take_their_documented_defaults() -> None:
    config = parse_config(MINIMAL)
    assert config.server == ServerConfig("127.0.0.1", 8000, 30.0, 30.0, (), ())
    assert config.engine == EngineConfig(2.5, 10.0, 120.0, 5.0, 5.0, 1.0, 30.0, True, None, None)
    assert config.serving == ServingConfig(600.0, 1, 10, 0.1, 4_194_304, 1024, 30.0)
    assert config.recovery == RecoveryConfig(3, 0.5, 10.0, 1.0, 0.0, RestartPolicy.INDIVIDUAL)
    assert config.journal == JournalConfig(None)
    assert config.engine_contract is None


def test_engine_entries_take_default_seats_and_no_identity_url_or_kv_hosts() -> None:
    spec = parse_config(MINIMAL).engines[0]
    assert spec == EngineSpec("p0", "http://10.0.0.1:8100", Role.PREFILL, 64, 256, None, ())


def test_non_streaming_decodes_are_streamed_unless_whole_is_asked_for() -> None:
    engine = parse_config(MINIMAL).engine
    assert engine.nonstream_decode is NonstreamDecode.STREAM
    assert engine.whole_answer_timeout_s == 0.0
    data = with_value("engine.nonstream_decode", "whole")
    whole = parse_config(with_value("engine.whole_answer_timeout_s", 30, data))
    assert whole.engine.nonstream_decode is NonstreamDecode.WHOLE
    assert whole.engine.whole_answer_timeout_s == 30.0
    # Unset, it never bounds a short deadline: nothing is derived.
    short = parse_config(with_value("serving.request_timeout_s", 1, data))
    assert "engine.whole_answer_timeout_s" not in short.derived


def test_toml_and_json_with_the_same_structure_give_equal_configs() -> None:
    assert load_config(DATA / "small.toml") == load_config(DATA / "small.json")


def test_a_file_config_carries_its_values() -> None:
    config = load_config(DATA / "small.toml")
    assert config.server.port == 9000
    assert config.engine.first_token_timeout_s == 3.0
    assert type(config.engine.first_token_timeout_s) is float
    assert config.recovery.restart_policy is RestartPolicy.WHOLE_WAVE
    assert config.engines[0].url == "http://127.0.0.1:8101"
    assert config.engines[1].max_decode_seats == 0
    assert config.engine_contract is not None
    assert dict(config.engine_contract.extra) == {"dtype": "bfloat16", "enforce_eager": True}


def test_the_example_fleet_validates() -> None:
    config = load_config(ROOT / "examples" / "fleet.toml")
    assert config.engine_contract is not None
    assert {spec.role for spec in config.engines} == {Role.PREFILL, Role.DECODE}
    assert config.tracing.enabled is False


def test_every_key_is_documented() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    classes = [
        ServerConfig,
        EngineConfig,
        ServingConfig,
        RecoveryConfig,
        JournalConfig,
        EngineContract,
        EngineSpec,
        TracingConfig,
        ControllerConfig,
        SloConfig,
        PlacementConfig,
    ]
    keys = {f.name for cls in classes for f in dataclasses.fields(cls)} - {"extra"}
    assert {key for key in keys if f"`{key}`" not in doc} == set()


def test_a_file_suffix_other_than_toml_or_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("model: m\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == ('unsupported file type ".yaml": use .toml or .json',)


def test_a_missing_file_is_a_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "absent.toml")
    assert caught.value.problems == ("file not found",)
    assert caught.value.source == str(tmp_path / "absent.toml")


def test_a_toml_syntax_error_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('model = "m"\n[server]\nport = \n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (message,) = caught.value.problems
    assert message.startswith("invalid TOML: ")
    assert "line 3" in message


def test_a_json_syntax_error_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text('{\n  "model": "m",\n  "server": {"port": }\n}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == ("invalid JSON: Expecting value (at line 3, column 22)",)


def test_a_file_that_is_not_utf8_is_a_problem(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_bytes(b'model = "\xff"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == ("not valid UTF-8 at byte 9",)


def test_a_json_file_must_hold_an_object(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == ("the top level must be a table of keys, got [1, 2]",)


# --- Ranges --------------------------------------------------------------------------------

REFUSED = [
    ("server.port", -1, "must be an integer in 0..65535, got -1"),
    ("server.port", 65536, "must be an integer in 0..65535, got 65536"),
    ("server.host", "", 'must be a non-empty string, got ""'),
    ("server.graceful_timeout_s", -0.5, "must be a number >= 0, got -0.5"),
    ("server.client_timeout_s", 0, "must be a number > 0, got 0"),
    ("engine.first_token_timeout_s", 0, "must be a number > 0, got 0"),
    ("engine.decode_read_timeout_s", -1, "must be a number >= 0, got -1"),
    ("engine.prefill_timeout_s", 0.0, "must be a number > 0, got 0.0"),
    ("engine.connect_timeout_s", -2, "must be a number > 0, got -2"),
    ("engine.health_timeout_s", 0, "must be a number > 0, got 0"),
    ("engine.kv_lease_s", 0, "must be a number > 0, got 0"),
    ("engine.release_abandoned", "yes", 'must be true or false, got "yes"'),
    ("engine.ca_bundle", "", 'must be a non-empty string, got ""'),
    ("engine.nonstream_decode", "bulk", 'must be one of "stream", "whole", got "bulk"'),
    ("engine.whole_answer_timeout_s", -1, "must be a number >= 0, got -1"),
    ("serving.request_timeout_s", 0, "must be a number > 0, got 0"),
    ("serving.max_attempts", 0, "must be an integer >= 1, got 0"),
    ("serving.retry_budget", -1, "must be an integer >= 0, got -1"),
    ("serving.retry_replenish", -0.1, "must be a number >= 0, got -0.1"),
    ("serving.max_request_bytes", 0, "must be an integer >= 1, got 0"),
    ("serving.queue_capacity", -1, "must be an integer >= 0, got -1"),
    ("serving.queue_timeout_s", 0, "must be a number > 0, got 0"),
    ("recovery.eject_after", 0, "must be an integer >= 1, got 0"),
    ("recovery.readmit_interval_s", 0, "must be a number > 0, got 0"),
    ("recovery.failure_quarantine_s", -1, "must be a number >= 0, got -1"),
    (
        "recovery.restart_policy",
        "rolling",
        'must be one of "individual", "whole_wave", got "rolling"',
    ),
    ("journal.path", "", 'must be a non-empty string, got ""'),
    ("engines[0].max_prefill_seats", -1, "must be an integer >= 0, got -1"),
    ("engines[0].max_decode_seats", -1, "must be an integer >= 0, got -1"),
]


@pytest.mark.parametrize(("path", "value", "message"), REFUSED)
def test_a_value_out_of_range_is_refused_naming_path_and_value(
    path: str, value: object, message: str
) -> None:
    assert problem(with_value(path, value)) == f"{path}: {message}"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("server.port", 0),
        ("server.port", 65535),
        ("server.graceful_timeout_s", 0),
        ("engine.decode_read_timeout_s", 0),
        ("serving.retry_budget", 0),
        ("serving.retry_replenish", 0),
        ("serving.queue_capacity", 0),
        ("recovery.failure_quarantine_s", 0.0),
        ("engines[0].max_prefill_seats", 0),
        ("engines[0].max_decode_seats", 0),
    ],
)
def test_a_value_on_the_edge_of_its_range_is_accepted(path: str, value: object) -> None:
    parse_config(with_value(path, value))


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 10**400])
def test_a_number_must_be_finite(value: object) -> None:
    message = problem(with_value("engine.kv_lease_s", value))
    assert message.startswith("engine.kv_lease_s: must be a finite number > 0, got ")


# --- Types ---------------------------------------------------------------------------------

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
ZERO_ALLOWED = {
    "server.graceful_timeout_s",
    "engine.decode_read_timeout_s",
    "serving.retry_replenish",
    "recovery.failure_quarantine_s",
}
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
WITH_CONTRACT = {**MINIMAL, "engine_contract": CONTRACT}


@given(path=st.sampled_from(INT_PATHS), value=st.booleans())
def test_a_boolean_is_not_an_integer(path: str, value: bool) -> None:
    shown = "true" if value else "false"
    assert problem(with_value(path, value, WITH_CONTRACT)).startswith(f"{path}: must be an integer")
    assert problem(with_value(path, value, WITH_CONTRACT)).endswith(f", got {shown}")


@given(path=st.sampled_from(FLOAT_PATHS), value=st.booleans())
def test_a_boolean_is_not_a_number(path: str, value: bool) -> None:
    assert problem(with_value(path, value)).startswith(f"{path}: must be a number")


@pytest.mark.parametrize("path", INT_PATHS)
def test_an_integer_key_refuses_a_float_even_a_whole_one(path: str) -> None:
    assert problem(with_value(path, 3.0, WITH_CONTRACT)).endswith(", got 3.0")


# Every timeout well below any whole number of seconds, so none breaks a cross-field rule.
QUICK = {
    **MINIMAL,
    "engine": {
        "prefill_timeout_s": 0.5,
        "decode_read_timeout_s": 0.5,
        "first_token_timeout_s": 0.5,
    },
    "serving": {"queue_timeout_s": 0.5},
}


@given(path=st.sampled_from(FLOAT_PATHS), value=st.integers(1, 10))
def test_a_number_key_accepts_an_integer_as_a_float(path: str, value: int) -> None:
    config = parse_config(with_value(path, value, QUICK))
    section, key = path.split(".")
    read = getattr(getattr(config, section), key)
    assert read == value
    assert type(read) is float


@pytest.mark.parametrize("path", FLOAT_PATHS)
def test_a_number_key_refuses_a_string(path: str) -> None:
    bound = ">= 0" if path in ZERO_ALLOWED else "> 0"
    assert problem(with_value(path, "5")) == f'{path}: must be a number {bound}, got "5"'


@given(
    path=st.sampled_from(STRING_PATHS),
    value=st.one_of(st.integers(), st.booleans(), st.lists(st.text(), max_size=2)),
)
def test_a_string_key_refuses_anything_but_a_string(path: str, value: object) -> None:
    assert problem(with_value(path, value, WITH_CONTRACT)).startswith(f"{path}: must ")


def test_a_role_must_be_one_of_the_three_names() -> None:
    data = with_value("engines[0].role", "PREFILL")
    assert problem(data) == (
        'engines[0].role: must be one of "prefill", "decode", "both", got "PREFILL"'
    )


@pytest.mark.parametrize("section", [*SECTIONS, "engine_contract"])
def test_a_section_must_be_a_table(section: str) -> None:
    assert problem({**MINIMAL, section: 5}) == f"{section}: must be a table, got 5"


def test_engines_must_be_a_list_of_tables() -> None:
    assert problem({**MINIMAL, "engines": {"id": "p0"}}) == (
        'engines: must be a list of tables, got {"id": "p0"}'
    )


def test_an_engine_entry_that_is_not_a_table_is_one_problem() -> None:
    data = copy.deepcopy(MINIMAL)
    data["engines"].append("http://10.0.0.3:8100")
    assert problems(data) == ('engines[2]: must be a table, got "http://10.0.0.3:8100"',)


def test_a_key_list_must_be_a_list_of_strings() -> None:
    assert problem(with_value("engines[0].kv_hosts", "10.0.0.9")) == (
        'engines[0].kv_hosts: must be a list of strings, got "10.0.0.9"'
    )


def test_a_kv_host_is_a_bare_host_name_or_address() -> None:
    assert problem(with_value("engines[0].kv_hosts", ["10.0.0.9", "http://10.0.0.9"])) == (
        'engines[0].kv_hosts[1]: must be a non-empty string, got "http://10.0.0.9"'
    )


# --- Unknown and missing keys --------------------------------------------------------------


@pytest.mark.parametrize("path", ["bogus", *(f"{section}.bogus" for section in SECTIONS)])
def test_an_unknown_key_is_refused_at_the_top_and_in_each_section(path: str) -> None:
    assert problem(with_value(path, 1)) == f"{path}: unknown key"


def test_an_unknown_key_in_an_engine_entry_is_refused() -> None:
    assert problem(with_value("engines[1].weight", 2)) == "engines[1].weight: unknown key"


def test_an_unknown_key_names_the_nearest_known_one() -> None:
    assert problem(with_value("serving.max_attempt", 2)) == (
        'serving.max_attempt: unknown key (did you mean "max_attempts"?)'
    )


@pytest.mark.parametrize("key", ["id", "url", "role"])
def test_an_engine_entry_needs_id_url_and_role(key: str) -> None:
    data = copy.deepcopy(MINIMAL)
    del data["engines"][0][key]
    assert problem(data) == f"engines[0].{key}: required key is missing"


def test_model_and_engines_are_required() -> None:
    assert problems({}) == ("model: required key is missing", "engines: required key is missing")


# --- The engine contract -------------------------------------------------------------------


def test_an_engine_contract_that_pins_nothing_is_refused() -> None:
    assert problem({**MINIMAL, "engine_contract": {}}) == (
        "engine_contract: pins nothing: name at least one field, or leave the table out"
    )


@pytest.mark.parametrize("key", sorted(CONTRACT))
def test_the_engine_contract_may_pin_any_one_field_alone(key: str) -> None:
    contract = parse_config({**MINIMAL, "engine_contract": {key: CONTRACT[key]}}).engine_contract
    assert contract is not None and contract.pinned() == {key: CONTRACT[key]}


def test_a_contract_field_left_out_is_not_pinned() -> None:
    data = {**MINIMAL, "engine_contract": {"engine_version": "0.32.0", "block_size": 128}}
    contract = parse_config(data).engine_contract
    assert contract == EngineContract(engine_version="0.32.0", block_size=128)
    assert contract.model is None and contract.tp_size is None


def test_the_engine_contract_keeps_other_keys_as_read_only_extras() -> None:
    data = {**MINIMAL, "engine_contract": {**CONTRACT, "dtype": "bfloat16", "max_model_len": 8192}}
    contract = parse_config(data).engine_contract
    extra: dict[str, ContractValue] = {"dtype": "bfloat16", "max_model_len": 8192}
    assert contract == EngineContract(
        "0.11.0", "m", "NixlConnector", 16, 1, MappingProxyType(extra)
    )
    assert dict(contract.extra) == extra
    with pytest.raises(TypeError):
        contract.extra["dtype"] = "float16"  # type: ignore[index]


def test_an_engine_contract_extra_must_be_a_scalar() -> None:
    data = {**MINIMAL, "engine_contract": {**CONTRACT, "gpus": ["H100"]}}
    assert problem(data) == (
        'engine_contract.gpus: must be a string, a finite number or a boolean, got ["H100"]'
    )


def test_the_engine_contract_model_must_be_the_served_model() -> None:
    data = {**MINIMAL, "engine_contract": {**CONTRACT, "model": "other"}}
    assert problem(data) == 'engine_contract.model: must equal model ("m"), got "other"'


# --- Engine URLs ---------------------------------------------------------------------------


def test_a_trailing_slash_is_dropped_from_an_engine_url() -> None:
    config = parse_config(with_value("engines[0].url", "https://gpu-1.internal/"))
    assert config.engines[0].url == "https://gpu-1.internal"


@pytest.mark.parametrize(
    ("url", "defect"),
    [
        ("10.0.0.9:8100", "must start with http:// or https://"),
        ("ftp://10.0.0.9", "must start with http:// or https://"),
        ("http://:8100", "must name a host"),
        ("http://10.0.0.9:8100/v1", 'must not have a path beyond "/" (the router adds the routes)'),
        ("http://10.0.0.9:8100?x=1", "must not have a query or fragment"),
        ("http://10.0.0.9:99999", "must have a port in 1..65535"),
        ("http://10.0.0.9:0", "must have a port in 1..65535"),
        ("http://10.0.0.9:", "must have a port in 1..65535"),
        ("http://k:s@10.0.0.9", "must not carry credentials (name them with engine.api_key_env)"),
        ("http://10.0.0.9 :8100", "must not contain whitespace"),
    ],
)
def test_an_engine_url_is_an_http_origin(url: str, defect: str) -> None:
    assert problem(with_value("engines[0].url", url)) == f'engines[0].url: {defect}, got "{url}"'


def test_an_identity_url_may_have_a_path() -> None:
    data = with_value("engines[0].identity_url", "http://10.0.0.1:9100/identity")
    assert parse_config(data).engines[0].identity_url == "http://10.0.0.1:9100/identity"


def test_an_engine_id_is_a_short_name_without_spaces() -> None:
    assert problem(with_value("engines[0].id", "p 0")) == (
        'engines[0].id: must be a string of 1 to 64 letters, digits, ".", "_" or "-", got "p 0"'
    )


# --- Cross-field rules ---------------------------------------------------------------------


def test_a_fleet_needs_at_least_one_engine() -> None:
    assert problem({**MINIMAL, "engines": []}) == "engines: at least one engine is required"


def test_a_fleet_needs_an_engine_that_may_prefill() -> None:
    data = with_value("engines[0].role", "decode")
    assert problem(data) == 'engines: no engine may prefill: give one the role "prefill" or "both"'


def test_a_fleet_needs_an_engine_that_may_decode() -> None:
    data = with_value("engines[1].role", "prefill")
    assert problem(data) == 'engines: no engine may decode: give one the role "decode" or "both"'


def test_one_engine_with_role_both_is_a_fleet() -> None:
    data = {"model": "m", "engines": [{"id": "b0", "url": "http://10.0.0.1:1", "role": "both"}]}
    assert parse_config(data).engines[0].role is Role.BOTH


def test_an_engine_id_is_unique() -> None:
    assert problem(with_value("engines[1].id", "p0")) == 'engines[1].id: duplicate engine id "p0"'


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8100", "http://10.0.0.1:8100/", "HTTP://10.0.0.1:8100"]
)
def test_an_engine_url_is_unique(url: str) -> None:
    assert problem(with_value("engines[1].url", url)) == (
        f'engines[1].url: duplicate engine url "{url.rstrip("/")}"'
    )


def test_urls_with_and_without_the_default_port_are_the_same_engine() -> None:
    data = with_value("engines[0].url", "http://gpu-1")
    data["engines"][1]["url"] = "http://gpu-1:80"
    assert problem(data) == 'engines[1].url: duplicate engine url "http://gpu-1:80"'


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000"),
        ("0.0.0.0", "http://localhost:8000"),
        ("router.internal", "http://router.internal:8000"),
    ],
)
def test_an_engine_url_must_not_be_the_router_itself(host: str, url: str) -> None:
    data = with_value("engines[0].url", url, with_value("server.host", host))
    assert problem(data) == (
        f'engines[0].url: points at the router itself (server.host "{host}", '
        f'server.port 8000), got "{url}"'
    )


@pytest.mark.parametrize(
    "path",
    [
        "engine.first_token_timeout_s",
        "engine.prefill_timeout_s",
        "engine.decode_read_timeout_s",
        "engine.whole_answer_timeout_s",
        "serving.queue_timeout_s",
    ],
)
def test_a_timeout_must_not_exceed_the_request_deadline(path: str) -> None:
    data = with_value(path, 151, with_value("serving.request_timeout_s", 150))
    assert problem(data) == f"{path}: must not exceed serving.request_timeout_s (150), got 151"


def test_a_zero_decode_read_timeout_leaves_the_request_deadline_in_charge() -> None:
    data = with_value("engine.decode_read_timeout_s", 0, with_value("serving.request_timeout_s", 5))
    data["engine"]["prefill_timeout_s"] = 5
    data["serving"]["queue_timeout_s"] = 5
    assert parse_config(data).engine.decode_read_timeout_s == 0.0


def test_an_empty_api_key_is_refused() -> None:
    assert problem(with_value("server.api_keys", ["k1", ""])) == (
        'server.api_keys[1]: must be a non-empty string, got ""'
    )


def test_a_cross_field_rule_is_skipped_while_one_of_its_keys_is_refused() -> None:
    data = with_value(
        "engine.first_token_timeout_s", 700, with_value("serving.request_timeout_s", -1)
    )
    assert problems(data) == ("serving.request_timeout_s: must be a number > 0, got -1",)


def test_a_refused_role_does_not_also_report_a_missing_leg() -> None:
    data = with_value("engines[1].role", "writer")
    assert problems(data) == (
        'engines[1].role: must be one of "prefill", "decode", "both", got "writer"',
    )


# --- Reports -------------------------------------------------------------------------------


def test_all_problems_are_collected_in_one_error() -> None:
    data = with_value("serving.bogus", 1, with_value("engine.first_token_timeout_s", -1))
    data["engines"][1]["id"] = "p0"
    data["engines"].append({"id": "w0", "url": "http://10.0.0.3:8100", "role": "writer"})
    assert problems(data) == (
        "engine.first_token_timeout_s: must be a number > 0, got -1",
        "serving.bogus: unknown key",
        'engines[2].role: must be one of "prefill", "decode", "both", got "writer"',
        'engines[1].id: duplicate engine id "p0"',
    )


def test_the_error_text_is_one_problem_per_line() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"model": ""}, source="<dev>")
    assert str(caught.value) == (
        'model: must be a non-empty string, got ""\nengines: required key is missing'
    )
    assert caught.value.report() == (
        "<dev>: 2 problems\n"
        '  model: must be a non-empty string, got ""\n'
        "  engines: required key is missing"
    )


def test_credentials_are_withheld_from_problems() -> None:
    secret = "sk-live-0123456789"
    found = problems(
        with_value("engine.api_key_env", secret, with_value("server.admin_api_keys", secret))
    )
    assert found == (
        "server.admin_api_keys: must be a list of strings, "
        "got a string of 18 characters (value withheld)",
        "engine.api_key_env: must be the name of an environment variable (letters, digits and "
        "_, not starting with a digit), got a string of 18 characters (value withheld)",
    )


def test_a_printed_config_does_not_show_api_keys() -> None:
    config = parse_config(with_value("server.api_keys", ["sk-live-0123456789"]))
    assert config.server.api_keys == ("sk-live-0123456789",)
    assert "sk-live" not in repr(config)


def test_validate_prints_a_summary_and_ok_and_returns_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert validate_command(DATA / "small.toml") == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{DATA / 'small.toml'}: OK",
        "  model: tiny",
        "  engines: 2 (1 prefill, 1 decode, 0 both)",
        "  timeouts: first token 3 s, decode read 10 s, prefill 20 s, queue 30 s, request 60 s",
        "  handoff bound: 25.4167 s (kv lease 30.5 s less a sixth)",
        "  breaker: eject after 3 failures, at most 0.5 of a phase ejected; readmission every "
        "10 s, 1 s while a phase has no admitted engine",
        '  engine contract: engine_version = "0.11.0", model = "tiny", connector = '
        '"NixlConnector", block_size = 16, tp_size = 1, dtype = "bfloat16", enforce_eager = true',
        "  tracing: on only if the environment names an OTLP endpoint (OTEL_EXPORTER_OTLP_*)",
    ]


def test_an_unset_timeout_is_clamped_to_the_request_deadline_and_shown_as_derived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({**MINIMAL, "serving": {"request_timeout_s": 2.5}}))
    config = load_config(path)
    assert config.serving.queue_timeout_s == 2.5
    assert config.engine.prefill_timeout_s == 2.5
    assert config.engine.decode_read_timeout_s == 2.5
    assert config.engine.first_token_timeout_s == 2.5
    assert validate_command(path) == 0
    out = capsys.readouterr().out
    assert "first token 2.5 s, decode read 2.5 s (derived), prefill 2.5 s (derived)" in out
    assert "queue 2.5 s (derived), request 2.5 s" in out


def test_an_unset_urgent_interval_follows_a_shorter_readmission_interval() -> None:
    config = parse_config({**MINIMAL, "recovery": {"readmit_interval_s": 0.5}})
    assert config.recovery.urgent_readmit_interval_s == 0.5
    assert config.derived == ("recovery.urgent_readmit_interval_s",)


def test_two_explicit_contradictory_values_are_still_an_error() -> None:
    data = {**MINIMAL, "serving": {"request_timeout_s": 2.5, "queue_timeout_s": 5}}
    assert problem(data) == (
        "serving.queue_timeout_s: must not exceed serving.request_timeout_s (2.5), got 5"
    )


def test_validate_reports_each_problem_and_returns_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(with_value("server.port", 70000, with_value("serving.x", 1))))
    assert validate_command(path) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"{path}: 2 problems",
        "  server.port: must be an integer in 0..65535, got 70000",
        "  serving.x: unknown key",
    ]


def test_validate_reports_a_missing_file_the_same_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert validate_command(tmp_path / "nope.toml") == 1
    assert capsys.readouterr().err == f"{tmp_path / 'nope.toml'}: 1 problem\n  file not found\n"


# --- The config object ---------------------------------------------------------------------


def test_roles_say_which_legs_they_permit() -> None:
    assert [(role.can_prefill, role.can_decode) for role in Role] == [
        (True, False),
        (False, True),
        (True, True),
    ]
    assert Role("both") is Role.BOTH


def test_the_handoff_bound_is_the_kv_lease_less_a_sixth() -> None:
    assert parse_config(with_value("engine.kv_lease_s", 600)).handoff_bound_s == pytest.approx(500)


def test_an_engine_is_found_by_its_id() -> None:
    config = parse_config(MINIMAL)
    assert config.engine_spec("d0").url == "http://10.0.0.2:8100"
    with pytest.raises(KeyError):
        config.engine_spec("x9")


def test_the_config_is_frozen() -> None:
    config = parse_config(MINIMAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.serving.max_attempts = 5  # type: ignore[misc]


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

"""The fleet file: defaults, strict types and ranges, unknown keys, cross-field rules and the
config object (reports: `test_report.py`; any valid fleet: `test_root_fleets.py`)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.config.controller import ControllerConfig, SloConfig
from narwhal.config.engine_spec import ContractValue, EngineContract, EngineSpec, Role
from narwhal.config.placement import PlacementConfig
from narwhal.config.responses import ResponsesConfig
from narwhal.config.root import (
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
from support.configs import (
    CONTRACT,
    FLOAT_PATHS,
    INT_PATHS,
    MINIMAL,
    SECTIONS,
    STRING_PATHS,
    problem,
    problems,
    with_value,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"

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
        ResponsesConfig,
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

ZERO_ALLOWED = {
    "server.graceful_timeout_s",
    "engine.decode_read_timeout_s",
    "serving.retry_replenish",
    "recovery.failure_quarantine_s",
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

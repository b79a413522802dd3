"""`narwhal config validate` and the error text: every problem reported, credentials withheld,
derived values shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.config.report import validate_command
from narwhal.config.root import (
    ConfigError,
    load_config,
    parse_config,
)
from support.configs import MINIMAL, problem, problems, with_value

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"


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

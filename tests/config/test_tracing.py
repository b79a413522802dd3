"""`[tracing]` in the fleet file, and how the OTEL_* environment turns it on or off."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config.root import ConfigError, parse_config
from narwhal.config.tracing import (
    DEFAULT_SERVICE_NAME,
    TracingConfig,
    TracingSettings,
    resolve_tracing,
)

BASE: dict[str, Any] = {
    "model": "tiny",
    "engines": [
        {"id": "p0", "url": "http://10.0.0.1:8100", "role": "prefill"},
        {"id": "d0", "url": "http://10.0.0.2:8200", "role": "decode"},
    ],
}
ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


def tracing(**table: object) -> TracingConfig:
    return parse_config({**BASE, "tracing": table}).tracing


def problems(**table: object) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as raised:
        parse_config({**BASE, "tracing": table})
    return raised.value.problems


def test_absent_table_leaves_everything_to_the_environment() -> None:
    assert parse_config(BASE).tracing == TracingConfig()


def test_keys_are_read() -> None:
    assert tracing(
        enabled=True,
        endpoint="https://collector.internal:4318/v1/traces",
        service_name="router-eu",
        sample_ratio=0.25,
    ) == TracingConfig(True, "https://collector.internal:4318/v1/traces", "router-eu", 0.25)


def test_an_endpoint_without_a_path_gets_the_traces_path() -> None:
    assert tracing(endpoint="http://collector:4318").endpoint == "http://collector:4318/v1/traces"
    assert tracing(endpoint="http://collector:4318/").endpoint == "http://collector:4318/v1/traces"
    assert tracing(endpoint="http://c:4318/custom").endpoint == "http://c:4318/custom"


def test_bad_keys_are_reported_by_path() -> None:
    assert problems(
        enabled="yes", endpoint="collector:4318", sample_ratio=1.5, service_name=""
    ) == (
        'tracing.enabled: must be true or false, got "yes"',
        'tracing.endpoint: must be an http:// or https:// URL, got "collector:4318"',
        'tracing.service_name: must be a non-empty string, got ""',
        "tracing.sample_ratio: must be a number in 0..1, got 1.5",
    )


def test_an_unknown_key_gets_a_suggestion() -> None:
    assert problems(enable=True) == ('tracing.enable: unknown key (did you mean "enabled"?)',)


def test_a_table_that_is_not_a_table_is_reported() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**BASE, "tracing": True})
    assert raised.value.problems == ("tracing: must be a table, got true",)


def test_off_without_the_file_or_an_otlp_endpoint() -> None:
    assert resolve_tracing(TracingConfig(), {}) is None
    assert resolve_tracing(TracingConfig(), {"OTEL_SERVICE_NAME": "x"}) is None


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_an_otlp_endpoint_in_the_environment_turns_it_on(variable: str) -> None:
    settings = resolve_tracing(TracingConfig(), {variable: "http://collector:4318"})
    # The exporter reads the endpoint itself; the service gets the default name.
    assert settings == TracingSettings(None, DEFAULT_SERVICE_NAME, None)


def test_the_file_turns_it_on_or_keeps_it_off() -> None:
    assert resolve_tracing(TracingConfig(enabled=True), {}) == TracingSettings(
        None, DEFAULT_SERVICE_NAME, None
    )
    assert resolve_tracing(TracingConfig(enabled=False), ENDPOINT) is None


def test_the_file_wins_over_the_environment_key_by_key() -> None:
    config = TracingConfig(True, "http://a:4318/v1/traces", "mine", 0.5)
    settings = resolve_tracing(config, {**ENDPOINT, "OTEL_SERVICE_NAME": "theirs"})
    assert settings == TracingSettings("http://a:4318/v1/traces", "mine", 0.5)


def test_otel_service_name_is_left_to_the_sdk_when_the_file_has_none() -> None:
    settings = resolve_tracing(TracingConfig(), {**ENDPOINT, "OTEL_SERVICE_NAME": "theirs"})
    assert settings == TracingSettings(None, None, None)


@pytest.mark.parametrize(
    "switch",
    [
        {"OTEL_SDK_DISABLED": "true"},
        {"OTEL_SDK_DISABLED": " TRUE "},
        {"OTEL_TRACES_EXPORTER": "none"},
    ],
)
def test_the_environment_switch_turns_it_off_whatever_the_file_says(
    switch: dict[str, str],
) -> None:
    assert resolve_tracing(TracingConfig(enabled=True), {**ENDPOINT, **switch}) is None


def test_otel_sdk_disabled_false_does_not_turn_it_off() -> None:
    assert resolve_tracing(TracingConfig(), {**ENDPOINT, "OTEL_SDK_DISABLED": "false"})

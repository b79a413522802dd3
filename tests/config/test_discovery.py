"""`[discovery]`: off by default; when on, a label selector is required and `[[engines]]`
may be left out, since the pods are the fleet."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config.discovery import Credentials, DiscoveryConfig
from narwhal.config.report import summary
from narwhal.config.root import ConfigError, parse_config

ENGINES = [
    {"id": "p", "url": "http://10.0.0.1:1", "role": "prefill"},
    {"id": "d", "url": "http://10.0.0.2:1", "role": "decode"},
]
ON = {"enabled": True, "label_selector": "app=vllm"}


def problems(data: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return caught.value.problems


def test_off_by_default_and_engines_stay_required() -> None:
    assert parse_config({"model": "m", "engines": ENGINES}).discovery == DiscoveryConfig()
    assert problems({"model": "m"}) == ("engines: required key is missing",)


def test_with_discovery_on_the_file_may_list_no_engine() -> None:
    config = parse_config({"model": "m", "discovery": ON})
    assert config.engines == () and config.discovery.label_selector == "app=vllm"
    assert parse_config({"model": "m", "discovery": ON, "engines": []}).engines == ()


def test_static_engines_of_one_phase_may_join_discovered_ones() -> None:
    config = parse_config({"model": "m", "discovery": ON, "engines": ENGINES[:1]})
    assert [spec.id for spec in config.engines] == ["p"]


def test_every_key_is_read() -> None:
    config = parse_config(
        {
            "model": "m",
            "discovery": {
                **ON,
                "namespace": "llm",
                "role_key": "example.com/role",
                "default_role": "both",
                "prefill_seats_key": "example.com/prefill",
                "decode_seats_key": "example.com/decode",
                "port_key": "example.com/port",
                "port_name": "http",
                "port": 8100,
                "scheme": "https",
                "credentials": "in_cluster",
                "kubeconfig": "/etc/kube/config",
                "context": "prod",
                "watch_timeout_s": 60,
                "backoff_s": 0.5,
                "max_backoff_s": 10,
            },
        }
    ).discovery
    assert (config.namespace, config.role_key, config.default_role) == (
        "llm",
        "example.com/role",
        "both",
    )
    assert (config.port_name, config.port, config.scheme.value) == ("http", 8100, "https")
    assert config.credentials is Credentials.IN_CLUSTER and config.context == "prod"
    assert (config.watch_timeout_s, config.backoff_s, config.max_backoff_s) == (60, 0.5, 10.0)


def test_a_selector_is_required_when_enabled() -> None:
    assert problems({"model": "m", "discovery": {"enabled": True}}) == (
        "discovery.label_selector: is required when discovery is enabled (which pods are "
        'engines, e.g. "app=vllm")',
    )


def test_bad_values_name_their_key() -> None:
    found = problems(
        {
            "model": "m",
            "discovery": {
                **ON,
                "kind": "consul",
                "namespace": "Not_A_Name",
                "default_role": "leader",
                "role_key": "bad key",
                "port": 0,
                "credentials": "token",
                "backoff_s": 5,
                "max_backoff_s": 1,
                "resync": 3,
            },
        }
    )
    assert found == (
        'discovery.kind: must be "kubernetes", got "consul"',
        'discovery.namespace: must be a Kubernetes namespace name, got "Not_A_Name"',
        'discovery.default_role: must be "prefill", "decode" or "both", got "leader"',
        'discovery.role_key: must be a label or annotation key, got "bad key"',
        "discovery.port: must be an integer in 1..65535, got 0",
        'discovery.credentials: must be one of "auto", "in_cluster", "kubeconfig", got "token"',
        "discovery.resync: unknown key",
    )


def test_max_backoff_may_not_be_below_backoff() -> None:
    assert problems({"model": "m", "discovery": {**ON, "backoff_s": 5, "max_backoff_s": 1}}) == (
        "discovery.max_backoff_s: must be at least backoff_s (5), got 1",
    )


def test_validate_reports_what_discovery_watches() -> None:
    config = parse_config({"model": "m", "discovery": {**ON, "port_name": "http"}})
    assert summary(config, "f.toml").splitlines()[-1] == (
        "  discovery: kubernetes pods in default matching 'app=vllm' (auto credentials); "
        "role from narwhal/role, port from narwhal/port else container port http"
    )

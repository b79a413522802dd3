"""`[[tenants]]` and `[tenants_policy]`: tenants' keys, weights, bands and limits."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config.root import ConfigError, parse_config
from narwhal.config.secrets import SecretsError, load_secrets
from narwhal.config.tenants import TenantConfig, TenantsPolicy

ENGINES = [
    {"id": "p0", "url": "http://10.0.0.1:1", "role": "prefill"},
    {"id": "d0", "url": "http://10.0.0.2:1", "role": "decode"},
]


def fleet(*tenants: dict[str, Any], **policy: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"model": "m", "engines": ENGINES, "tenants": list(tenants)}
    if policy:
        data["tenants_policy"] = policy
    return data


def problems(data: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return caught.value.problems


def test_no_tenants_is_the_default() -> None:
    config = parse_config({"model": "m", "engines": ENGINES})
    assert config.tenants == ()
    assert config.tenants_policy == TenantsPolicy()


def test_every_key_is_read() -> None:
    config = parse_config(
        fleet(
            {
                "name": "chat",
                "api_keys": ["k1"],
                "api_keys_env": "CHAT_KEYS",
                "weight": 3,
                "priority": -1,
                "max_concurrent": 8,
                "max_queued": 20,
                "requests_per_minute": 600,
                "tokens_per_minute": 90_000.5,
                "ttft_objective_s": 1.5,
            },
            {"name": "batch"},
            default="batch",
            engine_priority=True,
        )
    )
    assert config.tenants == (
        TenantConfig("chat", ("k1",), "CHAT_KEYS", 3.0, -1, 8, 20, 600.0, 90_000.5, 1.5),
        TenantConfig("batch"),
    )
    assert config.tenants_policy == TenantsPolicy(default="batch", engine_priority=True)
    assert config.tenants[0].limited and not config.tenants[1].limited


def test_a_key_is_withheld_from_repr() -> None:
    config = parse_config(fleet({"name": "chat", "api_keys": ["secret-key"]}))
    assert "secret-key" not in repr(config)


def test_bad_values_name_their_key_paths() -> None:
    found = problems(
        fleet(
            {"name": "a b", "weight": 0, "priority": 1.5, "max_concurrent": 0},
            {"name": "x", "requests_per_minute": -1, "tokens_per_minute": "lots", "colour": 1},
            engine_priority="yes",
        )
    )
    assert found == (
        'tenants[0].name: must be a name of letters, digits and _ . : - (at most 64), got "a b"',
        "tenants[0].weight: must be a number > 0, got 0",
        "tenants[0].priority: must be an integer (lower is served first), got 1.5",
        "tenants[0].max_concurrent: must be an integer >= 1, got 0",
        "tenants[1].requests_per_minute: must be a number > 0, got -1",
        'tenants[1].tokens_per_minute: must be a number > 0, got "lots"',
        "tenants[1].colour: unknown key",
        'tenants_policy.engine_priority: must be true or false, got "yes"',
    )


def test_names_are_unique_keys_belong_to_one_tenant_and_the_default_exists() -> None:
    found = problems(
        fleet(
            {"name": "a", "api_keys": ["k"]},
            {"name": "a"},
            {"name": "b", "api_keys": ["k"]},
            default="c",
        )
    )
    assert found == (
        'tenants[1].name: "a" is already the name of tenants[0]',
        'tenants[2].api_keys[0]: is already a key of tenant "a" (value withheld)',
        'tenants_policy.default: must name a tenant in [[tenants]] (a, b), got "c"',
    )


def test_tenant_keys_are_client_keys_and_name_their_tenant() -> None:
    config = parse_config(
        fleet(
            {"name": "chat", "api_keys": ["k1"], "api_keys_env": "CHAT_KEYS"},
            {"name": "batch", "api_keys": ["k9"]},
        )
    )
    secrets = load_secrets(config, {"CHAT_KEYS": "k2, k3"})
    assert set(secrets.client_keys) == {b"k1", b"k2", b"k3", b"k9"}
    assert secrets.tenant_of("Bearer k3") == "chat"
    assert secrets.tenant_of("Bearer k9") == "batch"
    assert secrets.tenant_of("Bearer nobody") is None
    assert secrets.tenant_of(None) is None


def test_a_tenant_key_variable_that_is_unset_is_refused() -> None:
    config = parse_config(fleet({"name": "chat", "api_keys_env": "CHAT_KEYS"}))
    with pytest.raises(SecretsError, match=r"tenants\[0\]\.api_keys_env names CHAT_KEYS"):
        load_secrets(config, {})


def test_reserved_seats_are_a_count() -> None:
    config = parse_config(fleet({"name": "chat"}, reserved_seats=4))
    assert config.tenants_policy.reserved_seats == 4
    assert problems(fleet({"name": "chat"}, reserved_seats=-1)) == (
        "tenants_policy.reserved_seats: must be an integer >= 0, got -1",
    )

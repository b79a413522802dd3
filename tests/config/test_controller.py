"""`[controller]`, `[slo]` and the engine keys `start_as` and `pin`."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config.controller import ControllerConfig
from narwhal.config.engine_spec import Role
from narwhal.config.root import ConfigError, parse_config


def fleet(**extra: Any) -> dict[str, Any]:
    engines = extra.pop("engines", None) or [
        {"id": "a", "url": "http://10.0.0.1:1", "role": "both", "start_as": "prefill"},
        {"id": "b", "url": "http://10.0.0.2:1", "role": "both", "start_as": "decode", "pin": True},
    ]
    return {"model": "m", "engines": engines, **extra}


def problems(data: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return caught.value.problems


def test_the_controller_is_off_by_default() -> None:
    config = parse_config(fleet())
    assert config.controller == ControllerConfig()
    assert not config.controller.enabled


def test_controller_slo_and_engine_keys_are_read() -> None:
    config = parse_config(
        fleet(
            controller={
                "enabled": True,
                "advisory": True,
                "interval_s": 2,
                "min_decode": 2,
                "max_moves": 3,
            },
            slo={"ttft_s": 0.5, "tpot_s": 0.02},
        )
    )
    assert config.controller.enabled and config.controller.advisory
    assert config.controller.interval_s == 2.0 and config.controller.min_decode == 2
    assert config.controller.max_moves == 3 and ControllerConfig().max_moves == 2
    assert (config.slo.ttft_s, config.slo.tpot_s) == (0.5, 0.02)
    a, b = config.engines
    assert (a.start_as, a.pin, b.start_as, b.pin) == (Role.PREFILL, False, Role.DECODE, True)


def test_bad_keys_are_named_by_path() -> None:
    found = problems(
        fleet(
            controller={
                "enabled": "yes",
                "interval_s": 0,
                "min_prefill": 0,
                "ratio": 0.5,
                "max_moves": 0,
                "dwel_s": 1,
            },
            slo={"ttft_s": -1},
        )
    )
    joined = "\n".join(found)
    for path in (
        "controller.enabled",
        "controller.interval_s",
        "controller.min_prefill",
        "controller.ratio",
        "controller.max_moves",
        "controller.dwel_s",
        "slo.ttft_s",
    ):
        assert f"{path}:" in joined
    assert 'did you mean "dwell_s"' in joined


def test_start_as_needs_role_both_and_a_phase() -> None:
    found = problems(
        fleet(
            engines=[
                {"id": "a", "url": "http://10.0.0.1:1", "role": "prefill", "start_as": "decode"},
                {"id": "b", "url": "http://10.0.0.2:1", "role": "both", "start_as": "both"},
                {"id": "c", "url": "http://10.0.0.3:1", "role": "decode", "pin": 1},
            ]
        )
    )
    joined = "\n".join(found)
    assert "engines[0].start_as: needs role" in joined
    assert "engines[1].start_as: must be" in joined
    assert "engines[2].pin: must be true or false" in joined


def test_starting_roles_must_cover_both_phases() -> None:
    found = problems(
        fleet(
            engines=[
                {"id": "a", "url": "http://10.0.0.1:1", "role": "both", "start_as": "decode"},
                {"id": "b", "url": "http://10.0.0.2:1", "role": "decode"},
            ]
        )
    )
    assert any("no engine may prefill" in p for p in found)

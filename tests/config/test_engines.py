"""The admin API's engine bodies: checked by the fleet file's rules, every problem named."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.engines import (
    EnginePatch,
    parse_engine_entry,
    parse_engine_patch,
    problem_path,
)
from narwhal.config.root import ConfigError, ServerConfig

SERVER = ServerConfig()
ENTRY: dict[str, Any] = {"id": "d9", "url": "http://10.0.0.9:8100/", "role": "decode"}


def entry_problems(raw: object) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_engine_entry(raw, SERVER)
    return caught.value.problems


def patch_problems(raw: object) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_engine_patch(raw)
    return caught.value.problems


def test_an_entry_takes_the_file_defaults_and_drops_a_trailing_slash() -> None:
    assert parse_engine_entry(ENTRY, SERVER) == EngineSpec(
        "d9", "http://10.0.0.9:8100", Role.DECODE, 64, 256, None, ()
    )


def test_an_entry_carries_every_key() -> None:
    raw = {
        **ENTRY,
        "role": "both",
        "max_prefill_seats": 2,
        "max_decode_seats": 0,
        "identity_url": "http://10.0.0.9:9000/identity",
        "kv_hosts": ["10.1.0.9"],
    }
    spec = parse_engine_entry(raw, SERVER)
    assert spec == EngineSpec(
        "d9",
        "http://10.0.0.9:8100",
        Role.BOTH,
        2,
        0,
        "http://10.0.0.9:9000/identity",
        ("10.1.0.9",),
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"id": "has space"}, "id: must be a string of 1 to 64"),
        ({"url": "ftp://x:1"}, "url: must start with http:// or https://"),
        ({"url": "http://x:1/v1"}, 'url: must not have a path beyond "/"'),
        ({"role": "router"}, 'role: must be one of "prefill", "decode", "both", got "router"'),
        ({"max_decode_seats": -1}, "max_decode_seats: must be an integer >= 0, got -1"),
        ({"max_prefill_seats": True}, "max_prefill_seats: must be an integer >= 0, got true"),
        ({"kv_hosts": [""]}, 'kv_hosts[0]: must be a non-empty string, got ""'),
        ({"seats": 3}, "seats: unknown key"),
        ({"url": "http://127.0.0.1:8000"}, "url: points at the router itself"),
    ],
)
def test_a_bad_entry_key_is_named_with_its_value(change: dict[str, Any], expected: str) -> None:
    (problem,) = entry_problems({**ENTRY, **change})
    assert problem.startswith(expected), problem


def test_every_problem_of_an_entry_is_reported_and_the_first_names_the_param() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_engine_entry({"url": "nope", "role": 1, "max_prefil_seats": 2}, SERVER)
    problems = caught.value.problems
    assert [p.split(":")[0] for p in problems] == ["id", "url", "role", "max_prefil_seats"]
    assert 'did you mean "max_prefill_seats"' in problems[-1]
    assert problem_path(caught.value) == "id"


@pytest.mark.parametrize("raw", [None, [], "d9", 3])
def test_an_entry_must_be_an_object(raw: object) -> None:
    (problem,) = entry_problems(raw)
    assert problem.startswith("must be an object of [[engines]] keys")


def test_a_patch_names_only_what_it_changes() -> None:
    assert parse_engine_patch({"max_decode_seats": 8}) == EnginePatch(max_decode_seats=8)
    assert parse_engine_patch({"role": "both", "pin": True}) == EnginePatch(Role.BOTH, pin=True)
    assert parse_engine_patch({"pin": False}) == EnginePatch(pin=False)


def test_a_patch_applies_role_and_seats_and_keeps_the_rest() -> None:
    spec = EngineSpec("d9", "http://h:1", Role.DECODE, 1, 2, "http://h:2/id", ("k",))
    patched = EnginePatch(Role.BOTH, max_prefill_seats=5, pin=True).apply(spec)
    assert patched == EngineSpec("d9", "http://h:1", Role.BOTH, 5, 2, "http://h:2/id", ("k",))
    assert EnginePatch().apply(spec) == spec


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"pin": "yes"}, ('pin: must be true or false, got "yes"',)),
        ({"role": "all"}, ('role: must be one of "prefill", "decode", "both", got "all"',)),
        ({"max_prefill_seats": -2}, ("max_prefill_seats: must be an integer >= 0, got -2",)),
        (
            {"url": "http://h:2", "pin": True},
            ("url: cannot change in place: delete the engine and add it anew",),
        ),
        ({"pin": True, "colour": 1}, ("colour: unknown key",)),
        ({"id": "d8"}, ("id: cannot change in place: delete the engine and add it anew",)),
    ],
)
def test_a_bad_patch_key_is_named(raw: dict[str, Any], expected: tuple[str, ...]) -> None:
    assert patch_problems(raw) == expected


@pytest.mark.parametrize("raw", [{}, {"colour": 1}])
def test_a_patch_that_changes_nothing_is_refused(raw: object) -> None:
    (problem,) = patch_problems(raw)
    assert problem.startswith("names nothing to change")


def test_a_patch_must_be_an_object() -> None:
    (problem,) = patch_problems(["pin"])
    assert problem.startswith("must be an object")

"""A reload's plan: every way a file's engine list can differ from the running fleet."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.root import Config, RecoveryConfig, ServerConfig, parse_config
from narwhal.fleet.reconfigure import IN_PLACE, Change, Plan, diff_engines, plan, restart_only

P0 = EngineSpec("p0", "http://10.0.0.1:8100", Role.PREFILL)
P1 = EngineSpec("p1", "http://10.0.0.2:8100", Role.PREFILL)
D0 = EngineSpec("d0", "http://10.0.0.3:8100", Role.DECODE)
D1 = EngineSpec("d1", "http://10.0.0.4:8100", Role.DECODE)


def config(*engines: EngineSpec, **sections: object) -> Config:
    return replace(Config("m", engines), **sections)  # type: ignore[arg-type]


def test_the_same_list_plans_nothing() -> None:
    result = diff_engines([P0, D0], [P0, D0])
    assert result == Plan() and result.empty


def test_order_alone_plans_nothing() -> None:
    assert diff_engines([P0, D0, D1], [D1, P0, D0]).empty


def test_a_new_id_is_added_in_the_files_order() -> None:
    assert diff_engines([P0], [D1, P0, D0]) == Plan(add=(D1, D0))


def test_a_missing_id_is_removed_in_the_fleets_order() -> None:
    assert diff_engines([P0, D1, P1, D0], [P0, D0]) == Plan(remove=("d1", "p1"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("role", Role.BOTH),
        ("max_prefill_seats", 3),
        ("max_decode_seats", 0),
        ("identity_url", "http://10.0.0.1:9000/id"),
        ("kv_hosts", ("10.1.0.1",)),
    ],
)
def test_each_in_place_key_is_a_change_naming_it(key: str, value: Any) -> None:
    changed = replace(P0, **{key: value})
    assert diff_engines([P0, D0], [changed, D0]) == Plan(change=(Change(changed, (key,)),))


def test_several_changed_keys_are_named_in_a_fixed_order() -> None:
    changed = replace(D0, max_decode_seats=4, role=Role.BOTH, kv_hosts=("h",))
    (change,) = diff_engines([D0], [changed]).change
    assert change.keys == ("role", "max_decode_seats", "kv_hosts")


def test_a_changed_url_is_a_problem_not_a_change() -> None:
    moved = replace(D0, url="http://10.0.0.9:8100", max_decode_seats=1)
    result = diff_engines([P0, D0], [P0, moved])
    assert result.change == () and result.add == () and result.remove == ()
    (problem,) = result.problems
    assert "d0" in problem and "http://10.0.0.9:8100" in problem and "new id" in problem


def test_add_change_and_remove_at_once() -> None:
    changed = replace(P1, role=Role.BOTH)
    result = diff_engines([P0, P1, D0], [changed, D1])
    assert result.add == (D1,)
    assert result.change == (Change(changed, ("role",)),)
    assert result.remove == ("p0", "d0")
    assert not result.empty


def test_an_empty_fleet_adds_everything_and_an_empty_file_removes_everything() -> None:
    assert diff_engines([], [P0, D0]) == Plan(add=(P0, D0))
    assert diff_engines([P0, D0], []) == Plan(remove=("p0", "d0"))


def test_sections_outside_engines_need_a_restart() -> None:
    running = config(P0, D0)
    loaded = config(P0, D0, server=ServerConfig(port=9000), recovery=RecoveryConfig(eject_after=5))
    assert restart_only(running, loaded) == ("server", "recovery")
    assert restart_only(running, replace(loaded, model="other"))[0] == "model"


def test_engines_and_derived_keys_alone_need_no_restart() -> None:
    running = config(P0, D0)
    assert restart_only(running, replace(running, engines=(P1, D1), derived=("x",))) == ()


def test_plan_combines_the_engine_difference_and_the_restart_keys() -> None:
    running = config(P0, D0)
    loaded = parse_config(
        {
            "model": "m",
            "serving": {"max_attempts": 2},
            "engines": [
                {"id": "p0", "url": P0.url, "role": "prefill"},
                {"id": "d1", "url": D1.url, "role": "decode"},
            ],
        }
    )
    result = plan([P0, D0], running, loaded)
    assert result.add == (D1,) and result.remove == ("d0",)
    assert result.restart_required == ("serving",)


def test_plan_diffs_against_the_live_fleet_not_the_running_file() -> None:
    # Engines added at runtime but absent from the file are removed by a reload.
    running = config(P0, D0)
    result = plan([P0, D0, D1], running, running)
    assert result.remove == ("d1",) and result.restart_required == ()


specs = st.builds(
    EngineSpec,
    id=st.sampled_from(["a", "b", "c", "d"]),
    url=st.sampled_from(["http://h1:1", "http://h2:2"]),
    role=st.sampled_from(list(Role)),
    max_prefill_seats=st.integers(0, 3),
    max_decode_seats=st.integers(0, 3),
)
fleets = st.lists(specs, max_size=4, unique_by=lambda s: s.id)


@given(fleets, fleets)
def test_applying_a_plan_without_problems_gives_the_file(
    live: list[EngineSpec], target: list[EngineSpec]
) -> None:
    result = diff_engines(live, target)
    moved = {s.id for s in target} & {s.id for s in live if s not in target}
    if result.problems:
        return
    applied = {s.id: s for s in live if s.id not in result.remove}
    for change in result.change:
        assert set(change.keys) <= set(IN_PLACE)
        applied[change.spec.id] = change.spec
    for spec in result.add:
        assert spec.id not in applied
        applied[spec.id] = spec
    assert applied == {s.id: s for s in target}
    assert not moved or all(
        next(s for s in live if s.id == i).url == next(s for s in target if s.id == i).url
        for i in moved
    )


@given(fleets, fleets)
def test_a_problem_is_reported_exactly_for_each_id_whose_url_changed(
    live: list[EngineSpec], target: list[EngineSpec]
) -> None:
    urls = {s.id: s.url for s in live}
    changed = [s.id for s in target if s.id in urls and urls[s.id] != s.url]
    problems = diff_engines(live, target).problems
    assert len(problems) == len(changed)
    for engine_id, problem in zip(changed, problems, strict=True):
        assert problem.startswith(f"engines: {engine_id}: url changed")


def test_tenants_limits_and_policy_apply_without_a_restart_but_keys_need_one() -> None:
    def tenants(**batch: Any) -> Config:
        return parse_config(
            {
                "model": "m",
                "engines": [{"id": "p0", "url": P0.url, "role": "both"}],
                "tenants": [{"name": "chat", "api_keys": ["k1"]}, {"name": "batch", **batch}],
                "tenants_policy": {"engine_priority": "priority" in batch},
            }
        )

    running = tenants()
    assert restart_only(running, tenants(priority=2, requests_per_minute=60)) == ()
    assert restart_only(running, tenants(api_keys=["k2"])) == ("tenants",)
    # Turning tenants on or off changes how every request is admitted: a restart.
    assert restart_only(config(P0, D0), running) == ("tenants",)
    assert restart_only(running, replace(running, tenants=())) == ("tenants",)


def test_reserved_seats_wait_for_a_restart() -> None:
    def with_reserve(seats: int) -> Config:
        return parse_config(
            {
                "model": "m",
                "engines": [{"id": "p0", "url": P0.url, "role": "both"}],
                "tenants": [{"name": "chat"}],
                "tenants_policy": {"reserved_seats": seats, "default": "chat"},
            }
        )

    assert restart_only(with_reserve(0), with_reserve(2)) == ("tenants_policy",)

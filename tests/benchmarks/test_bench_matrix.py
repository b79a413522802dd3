"""The feature matrix flips each feature from its default and prices it against the plain
router; the plain router the bench (and its guard) measures has every default-on feature on."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from bench_matrix import FEATURES, PLAIN, Feature, feature_cost, format_matrix
from bench_model import BenchOptions, BenchReport, Summary
from bench_targets import narwhal_config

from narwhal.config.root import Config, parse_config

FLEET = ("http://127.0.0.1:9001", "http://127.0.0.1:9002")


def configured(
    settings: dict[str, dict[str, object]] | None = None,
    tenants: tuple[Mapping[str, object], ...] = (),
) -> Config:
    text = narwhal_config(*FLEET, 8000, settings=settings, tenants=tenants)
    return parse_config(tomllib.loads(text))


def summary(name: str, cpu_per_1k: float | None) -> Summary:
    figures: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(Summary)}
    figures |= {"name": name, "router_cpu_s_per_1k_requests": cpu_per_1k}
    figures |= {"error_samples": (), "requests_per_s": 100.0}
    return Summary(**figures)


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_each_feature_row_is_a_valid_configuration_that_differs_from_the_plain_one(
    feature: Feature, tmp_path: Path
) -> None:
    settings = feature.resolved(tmp_path)
    if feature.traced:
        settings["tracing"] |= {"enabled": True, "endpoint": "http://127.0.0.1:4318/v1/traces"}
    assert configured(settings, feature.tenants) != configured()


@pytest.mark.parametrize("feature", [f for f in FEATURES if f.default_on], ids=lambda f: f.name)
def test_the_plain_router_measured_by_the_bench_and_its_guard_keeps_default_on_features_on(
    feature: Feature,
) -> None:
    # The plain configuration leaves each default-on feature's keys at their defaults, so
    # turning the feature off is a change and its cost is inside the plain router's figures.
    plain = configured()
    for table, keys in feature.settings.items():
        section = getattr(plain, table)
        for key, off in keys.items():
            assert getattr(section, key) != off, f"{table}.{key} is already off"


def test_a_default_off_feature_costs_what_turning_it_on_adds() -> None:
    on = next(f for f in FEATURES if not f.default_on)
    assert feature_cost(on, summary(PLAIN, 0.5), summary(on.target, 0.6)) == pytest.approx(0.2)


def test_a_default_on_feature_costs_what_turning_it_off_saves() -> None:
    off = next(f for f in FEATURES if f.default_on)
    cost = feature_cost(off, summary(PLAIN, 0.55), summary(off.target, 0.5))
    assert cost == pytest.approx(0.1)


def test_the_matrix_shows_every_flipped_router_with_its_cost_beside_the_peers() -> None:
    on, off = (
        next(f for f in FEATURES if not f.default_on),
        next(f for f in FEATURES if f.default_on),
    )
    report = BenchReport(
        BenchOptions(matrix=True),
        (
            summary(PLAIN, 0.5),
            summary(on.target, 0.75),
            summary(off.target, 0.4),
            summary("vllm-router", 0.3),
        ),
        (),
    )
    table = format_matrix(report)
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert "+50.0 %" in lines[on.target]
    assert "+25.0 %" in lines[off.target]
    assert "0.300" in lines["vllm-router"]
    assert f"{on.name}: {on.about}" in table

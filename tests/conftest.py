"""Shared fixtures; every test runs on uvloop, the event loop Narwhal runs on in production."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

from support.stack import LANES, StackFactory, stack_factory

# A shared machine is slow at times: property tests judge results, never their speed. In CI
# the examples are the same every run, so that a submission's result is reproducible.
settings.register_profile("narwhal", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("narwhal"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "narwhal")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], Any]]:
    return {"uvloop": uvloop.new_event_loop}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_lanes: every test runs over both client-facing servers (`lane`)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "lane" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_lanes"):
        metafunc.parametrize("lane", LANES)


@pytest.fixture
def lane() -> str:
    """The server the stack's clients reach: the fast lane, unless the test is marked
    `both_lanes`, which runs it over each."""
    return "fast"


@pytest.fixture
def make_stack(tmp_path: Path, lane: str) -> StackFactory:
    """`async with make_stack(roles, engine={...}, sim={...}) as stack:` (see `support`)."""
    return stack_factory(tmp_path, lane)

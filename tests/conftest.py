"""Shared fixtures; every test runs on uvloop, the event loop Narwhal runs on in production."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

from support.stack import StackFactory, stack_factory

# A shared machine is slow at times: property tests judge results, never their speed. In CI
# the examples are the same every run, so that a submission's result is reproducible.
settings.register_profile("narwhal", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("narwhal"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "narwhal")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], Any]]:
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def make_stack(tmp_path: Path) -> StackFactory:
    """`async with make_stack(roles, engine={...}, sim={...}) as stack:` (see `support`)."""
    return stack_factory(tmp_path)

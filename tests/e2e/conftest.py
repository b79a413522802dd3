"""Fixtures for end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import StackFactory, stack_factory


@pytest.fixture
def make_stack(tmp_path: Path) -> StackFactory:
    return stack_factory(tmp_path)

"""A serving process collects garbage less often than CPython's defaults; others keep them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from narwhal.runtime import main as runtime


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


async def _collector() -> tuple[tuple[int, int, int], int]:
    return gc.get_threshold(), gc.get_freeze_count()


def test_a_server_runs_with_the_server_thresholds_and_start_up_frozen(
    restored_collector: None,
) -> None:
    thresholds, frozen = runtime.run(_collector(), server=True)
    assert thresholds == runtime.SERVER_GC_THRESHOLDS
    assert frozen > 0


def test_any_other_command_keeps_the_collector_as_it_was(restored_collector: None) -> None:
    before = gc.get_threshold()
    thresholds, frozen = runtime.run(_collector())
    assert thresholds == before
    assert frozen == gc.get_freeze_count()

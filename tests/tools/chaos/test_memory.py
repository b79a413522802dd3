"""The soak's memory check: a flat RSS passes, a growing one does not."""

from __future__ import annotations

import pytest

from narwhal.tools.chaos.memory import memory_trend

MB = 2**20


def test_flat_memory_after_warm_up_is_stable() -> None:
    warm_up = [(t, (40 + t) * MB) for t in range(10)]
    flat = [(10 + t, (50 + t % 3) * MB) for t in range(100)]
    trend = memory_trend(warm_up + flat)
    assert trend.stable and abs(trend.slope_mb_per_min) < 1


def test_memory_that_keeps_growing_is_not_stable() -> None:
    samples = [(t, 50 * MB + t * MB // 2) for t in range(100)]
    trend = memory_trend(samples)
    assert not trend.stable and trend.slope_mb_per_min == pytest.approx(30)

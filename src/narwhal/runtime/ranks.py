"""Percentiles by nearest rank, shared by the fleet page, the journal summary and the controller."""

from __future__ import annotations

import math


def nearest_rank(ordered: list[float], q: float) -> float:
    """The smallest value with at least q% of the values at or below it."""
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]

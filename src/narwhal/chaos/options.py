"""What one soak is asked to do."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChaosOptions:
    """One run: `requests` in all, or as many as fit in `minutes` when that is given."""

    requests: int = 1000
    minutes: float | None = None
    seed: int = 0
    prefill: int = 2
    decode: int = 2
    concurrency: int = 32
    fault_every_s: float = 0.2  # mean time between injected faults
    leave_share: float = 0.1  # clients that give up part-way
    # Engines of role both, started in their phase, moved by the role controller (the
    # first decode engine pinned, when there are two or more).
    controller: bool = False

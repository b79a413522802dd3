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
    # Three consumers, so that one crashing mid-answer while another is quarantined by a
    # fault still leaves one admitted to continue the answer on.
    decode: int = 3
    concurrency: int = 32
    fault_every_s: float = 0.2  # mean time between injected faults
    leave_share: float = 0.1  # clients that give up part-way
    # Engines of role both, started in their phase, moved by the role controller (the
    # first decode engine pinned, when there are two or more).
    controller: bool = False
    # Stream continuation on (off only to show that the soak's check catches its absence).
    continuation: bool = True

"""Per-phase latencies of recently finished requests, for the role controller.

Fed once per finished request (a call hook): its time to first token, the prefill side's
measure, and its time per output token after the first, the decode side's. Memory is bounded
by a fixed number of samples; `p90` looks back over a sliding window.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from narwhal.router.recent import nearest_rank

if TYPE_CHECKING:
    from narwhal.router.call import Call

MAX_SAMPLES = 4096


class PhaseLatency:
    """(finish time, ttft_s, tpot_s) of the latest successful requests."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._samples: deque[tuple[float, float | None, float | None]] = deque(maxlen=max_samples)

    def add(self, call: Call, now: float) -> None:
        """`now` is the request's end on `time.perf_counter()`, as `call.arrival` is."""
        if call.status != 200 or call.ttft_s is None:
            return
        tokens = call.output_tokens or 0
        tpot = (now - call.arrival - call.ttft_s) / (tokens - 1) if tokens > 1 else None
        self._samples.append((now, call.ttft_s, tpot if tpot is None else max(0.0, tpot)))

    def record(self, now: float, ttft_s: float | None, tpot_s: float | None) -> None:
        """A sample given directly (tests, other feeds)."""
        self._samples.append((now, ttft_s, tpot_s))

    def p90(
        self, now: float, window_s: float
    ) -> tuple[tuple[float | None, int], tuple[float | None, int]]:
        """((TTFT p90, samples), (TPOT p90, samples)) over the last `window_s`."""
        since = now - window_s
        ttft = sorted(s[1] for s in self._samples if s[0] >= since and s[1] is not None)
        tpot = sorted(s[2] for s in self._samples if s[0] >= since and s[2] is not None)
        return (
            (nearest_rank(ttft, 90) if ttft else None, len(ttft)),
            (nearest_rank(tpot, 90) if tpot else None, len(tpot)),
        )

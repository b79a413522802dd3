"""Per-phase latencies of recently finished requests, for the role controller.

A request's time to first token has two parts, and each belongs to one phase: up to the
descriptor (the router's seat queue and the prefill leg: waiting for and running the
prompt on a producer) is prefill's; from the descriptor to the consumer's first token (the
KV pull, and waiting for a place in a consumer's batch when its batch is full) is
decode's. Time
per output token after the first is decode's too. Splitting TTFT this way keeps a full
decode batch from reading as prefill pressure.

Fed once per finished request (a call hook). Memory is bounded by a fixed number of
samples; `window` looks back over a sliding span of finish times, and can leave out
requests that arrived before some moment (a move: they were placed on the old split).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from narwhal.router.recent import nearest_rank

if TYPE_CHECKING:
    from narwhal.router.call import Call

MAX_SAMPLES = 4096


@dataclass(frozen=True, slots=True)
class Sample:
    """One successful request, times on `time.perf_counter()`."""

    arrival: float
    finished: float
    # Arrival to the prefill leg's end (the descriptor and the producer's first token);
    # the whole TTFT when no prefill leg ran (the consumer computed the prompt itself,
    # which is prefill work).
    prefill_s: float
    # Descriptor to the consumer's first token; None without a prefill leg.
    first_token_wait_s: float | None
    # Time per output token after the first; None with a single output token.
    tpot_s: float | None


@dataclass(frozen=True, slots=True)
class Percentile:
    """A p90 over the window and the samples it was taken from (None: no sample)."""

    p90_s: float | None
    samples: int


@dataclass(frozen=True, slots=True)
class WindowLatency:
    prefill: Percentile
    first_token_wait: Percentile
    tpot: Percentile


def sample_of(call: Call, now: float) -> Sample | None:
    """The request's sample, or None when it did not succeed with a first token."""
    if call.status != 200 or call.ttft_s is None:
        return None
    # The router's `ttft_s` is the producer's first token (the prefill leg's end), or the
    # consumer's first byte when it served the request alone.
    first = call.ttft_s if call.first_byte_s is None else max(call.ttft_s, call.first_byte_s)
    alone = call.handoff == "fallback" or call.first_byte_s is None
    tokens = call.output_tokens or 0
    tpot = (now - call.arrival - first) / (tokens - 1) if tokens > 1 else None
    return Sample(
        arrival=call.arrival,
        finished=now,
        prefill_s=call.ttft_s,
        first_token_wait_s=None if alone else first - call.ttft_s,
        tpot_s=None if tpot is None else max(0.0, tpot),
    )


class PhaseLatency:
    """The latest successful requests' samples."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._samples: deque[Sample] = deque(maxlen=max_samples)

    def add(self, call: Call, now: float) -> None:
        """`now` is the request's end on `time.perf_counter()`, as `call.arrival` is."""
        sample = sample_of(call, now)
        if sample is not None:
            self._samples.append(sample)

    def record(self, sample: Sample) -> None:
        """A sample given directly (tests, other feeds)."""
        self._samples.append(sample)

    def window(
        self, now: float, window_s: float, arrived_since: float | None = None
    ) -> WindowLatency:
        """p90s over requests that finished in the last `window_s` and arrived at or after
        `arrived_since` (when given)."""
        since = now - window_s
        recent = [
            s
            for s in self._samples
            if s.finished >= since and (arrived_since is None or s.arrival >= arrived_since)
        ]
        return WindowLatency(
            _p90([s.prefill_s for s in recent]),
            _p90([s.first_token_wait_s for s in recent if s.first_token_wait_s is not None]),
            _p90([s.tpot_s for s in recent if s.tpot_s is not None]),
        )


def _p90(values: list[float]) -> Percentile:
    values.sort()
    return Percentile(nearest_rank(values, 90) if values else None, len(values))

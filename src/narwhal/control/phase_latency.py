"""Per-phase latencies of recently finished requests, for the role controller.

A request's time to first token has two parts, and each belongs to one phase: up to the
descriptor (the router's seat queue and the prefill leg: waiting for and running the
prompt on a producer) is prefill's; from the descriptor to the consumer's first token (the
KV pull, and waiting for a place in a consumer's batch when its batch is full) is
decode's. Time
per output token after the first is decode's too. Splitting TTFT this way keeps a full
decode batch from reading as prefill pressure.

Fed twice per request: at its first token (the TTFT parts, as soon as they are known, so
that a long answer does not delay the evidence by its length) and at its end (time per
output token). Memory is bounded by a fixed number of samples; `window` looks back over a
sliding span of those times, and can leave out requests that arrived before some moment (a
move: they were placed on the old split).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from narwhal.runtime.ranks import nearest_rank

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


def sample_of(call: Call, now: float, *, finished: bool = True) -> Sample | None:
    """The request's sample at `now`, or None when it has no first token (or, once
    `finished`, did not succeed)."""
    if call.ttft_s is None or (finished and call.status != 200):
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
    """The latest requests' first-token parts and times per output token."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        # (arrival, first token at, prefill_s, first_token_wait_s)
        self._firsts: deque[tuple[float, float, float, float | None]] = deque(maxlen=max_samples)
        # (arrival, finished, tpot_s)
        self._tpots: deque[tuple[float, float, float]] = deque(maxlen=max_samples)

    def first_token(self, call: Call, now: float) -> None:
        """The request's first token is on its way to the client (`now` on
        `time.perf_counter()`, as `call.arrival` is)."""
        sample = sample_of(call, now, finished=False)
        if sample is not None:
            self._firsts.append((sample.arrival, now, sample.prefill_s, sample.first_token_wait_s))

    def add(self, call: Call, now: float) -> None:
        """The request ended at `now`: its time per output token, if it succeeded."""
        sample = sample_of(call, now)
        if sample is not None and sample.tpot_s is not None:
            self._tpots.append((sample.arrival, now, sample.tpot_s))

    def record(self, sample: Sample) -> None:
        """A finished request given directly (tests, other feeds): its first token came
        `prefill_s` and `first_token_wait_s` after its arrival."""
        first_at = sample.arrival + sample.prefill_s + (sample.first_token_wait_s or 0.0)
        self._firsts.append((sample.arrival, first_at, sample.prefill_s, sample.first_token_wait_s))
        if sample.tpot_s is not None:
            self._tpots.append((sample.arrival, sample.finished, sample.tpot_s))

    def window(
        self, now: float, window_s: float, arrived_since: float | None = None
    ) -> WindowLatency:
        """p90s over first tokens and ends in the last `window_s`, of requests that arrived
        at or after `arrived_since` (when given)."""
        since = now - window_s
        after = -math.inf if arrived_since is None else arrived_since
        firsts = [f for f in self._firsts if f[1] >= since and f[0] >= after]
        tpots = [t[2] for t in self._tpots if t[1] >= since and t[0] >= after]
        return WindowLatency(
            _p90([f[2] for f in firsts]),
            _p90([f[3] for f in firsts if f[3] is not None]),
            _p90(tpots),
        )


def _p90(values: list[float]) -> Percentile:
    values.sort()
    return Percentile(nearest_rank(values, 90) if values else None, len(values))

"""Goodput arithmetic: which requests met their SLOs, latency percentiles, the best split.

Pure. Times are in trace seconds (what a GPU fleet would see), already multiplied back by
the replay's speed. A request is good when it completed with TTFT <= slo.ttft_s and TPOT
<= slo.tpot_s; goodput is good requests per second of the phase.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from narwhal.tools.sim.timing import StepCosts, StepPlan, step_seconds

SLO_TTFT_FACTOR = 5.0
"""Default TTFT SLO: this many times a lone 4096-token prompt's prefill on the profile."""

SLO_TPOT_FACTOR = 3.0
"""Default TPOT SLO: this many times a lone sequence's decode step at 2048 tokens of context."""


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float


def default_slo(costs: StepCosts, request_overhead_s: float = 0.0) -> Slo:
    """SLOs a profile can meet when lightly loaded, and misses when overloaded."""
    prefill = request_overhead_s
    left = 4096
    while left > 0:  # a prompt larger than the budget takes several steps
        chunk = min(left, costs.max_num_batched_tokens)
        prefill += step_seconds(costs, StepPlan((chunk,), 0, 0))
        left -= chunk
    decode = step_seconds(costs, StepPlan((), 1, 2048))
    return Slo(SLO_TTFT_FACTOR * prefill, SLO_TPOT_FACTOR * decode)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One replayed request: its phase and, if it completed, its latencies."""

    phase: str
    completed: bool
    ttft_s: float | None = None
    tpot_s: float | None = None  # None with a single output token
    arrival_s: float = 0.0  # when the trace sent it (a return: when it was sent again)
    # With tenants: whose it was, its HTTP status (0: no answer), the tokens served (the
    # engine's usage when the stream carried it), whether it was a refused request sent
    # again after its Retry-After, and that Retry-After when it was refused.
    tenant: str = ""
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    returned: bool = False
    retry_after_s: float | None = None

    def good(self, slo: Slo) -> bool:
        return (
            self.completed
            and self.ttft_s is not None
            and self.ttft_s <= slo.ttft_s
            and (self.tpot_s is None or self.tpot_s <= slo.tpot_s)
        )

    def pressure(self, slo: Slo) -> float:
        """The tighter SLO's share used (1 at the limit; infinite for a failure)."""
        if not self.completed or self.ttft_s is None:
            return math.inf
        tpot = 0.0 if self.tpot_s is None else self.tpot_s / slo.tpot_s
        return max(self.ttft_s / slo.ttft_s, tpot)


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True, slots=True)
class PhaseStats:
    requests: int
    completed: int
    good: int
    goodput_rps: float
    ttft_s: Percentiles
    tpot_s: Percentiles
    pressure_p90: float  # for ties: the split that meets its SLOs with more room

    def to_json(self) -> dict[str, object]:
        value = asdict(self)
        if math.isinf(self.pressure_p90):
            value["pressure_p90"] = None
        return value


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _percentiles(values: Sequence[float]) -> Percentiles:
    return Percentiles(percentile(values, 50), percentile(values, 90), percentile(values, 99))


def phase_stats(outcomes: Sequence[Outcome], slo: Slo, duration_s: float) -> PhaseStats:
    """Stats of one phase's requests (or all of them) over its `duration_s`."""
    good = sum(outcome.good(slo) for outcome in outcomes)
    ttft = [o.ttft_s for o in outcomes if o.completed and o.ttft_s is not None]
    tpot = [o.tpot_s for o in outcomes if o.completed and o.tpot_s is not None]
    pressure = percentile([o.pressure(slo) for o in outcomes], 90)
    return PhaseStats(
        requests=len(outcomes),
        completed=sum(outcome.completed for outcome in outcomes),
        good=good,
        goodput_rps=good / duration_s if duration_s > 0 else 0.0,
        ttft_s=_percentiles(ttft),
        tpot_s=_percentiles(tpot),
        pressure_p90=math.inf if pressure is None else pressure,
    )


ALL = "all"


def split_stats(
    outcomes: Sequence[Outcome], slo: Slo, durations: Mapping[str, float]
) -> dict[str, PhaseStats]:
    """Per phase (in `durations`' order) and over the whole trace (`all`)."""
    stats = {
        phase: phase_stats([o for o in outcomes if o.phase == phase], slo, duration)
        for phase, duration in durations.items()
        if phase != ALL
    }
    stats[ALL] = phase_stats(outcomes, slo, sum(durations.values()))
    return stats


STEADY = "steady"


def steady_stats(
    outcomes: Sequence[Outcome],
    slo: Slo,
    runs: Sequence[tuple[str, float, float]],
    settle_s: float,
) -> dict[str, PhaseStats]:
    """Per phase, over requests that arrived after the first `settle_s` of one of its runs
    (`runs`: phase, start, end), as "<phase> steady": a phase once a split has had time to
    follow it, apart from the shift into it."""
    steady: dict[str, list[tuple[float, float]]] = {}
    for phase, start, end in runs:
        if end - start > settle_s:
            steady.setdefault(phase, []).append((start + settle_s, end))
    return {
        f"{phase} {STEADY}": phase_stats(
            [
                o
                for o in outcomes
                if o.phase == phase and any(a <= o.arrival_s < b for a, b in spans)
            ],
            slo,
            sum(b - a for a, b in spans),
        )
        for phase, spans in steady.items()
    }


def best_split(results: Mapping[int, Mapping[str, PhaseStats]], phase: str = ALL) -> int | None:
    """The prefill count with the most goodput in `phase`; on a tie, the one with the most
    room under its SLOs (lower p90 pressure), then the fewer prefill engines."""
    candidates = [(prefill, stats[phase]) for prefill, stats in results.items() if phase in stats]
    if not candidates:
        return None
    return min(candidates, key=lambda c: (-c[1].good, c[1].pressure_p90, c[0]))[0]

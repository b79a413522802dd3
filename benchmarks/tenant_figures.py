"""The tenants experiments' figures, from the clients' records and the router's journal.

Pure: what the calibration, the limits and the journal say, and each figure against its
target (`benchmarks/tenant_experiments.py` takes and prints them).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from narwhal.tools.goodput.score import percentile
from narwhal.tools.goodput.tenants import Record, TenantStats


@dataclass(frozen=True, slots=True)
class Verdict:
    """One figure against its target."""

    experiment: str
    figure: str
    value: str
    target: str
    met: bool | None  # None: no verdict (the figure could not be taken)


def capacity_rps(records: Sequence[Record], window: tuple[float, float]) -> float:
    """Requests answered per second, by their end, within `window` (start, end)."""
    start, end = window
    done = sum(1 for r in records if r.ok and start <= r.ended_s < end)
    return done / (end - start)


def bucket_allows(limit_per_minute: float, span_s: float) -> float:
    """What a per-minute token bucket admits over `span_s` of constant demand: it starts
    full (the limit) and refills at limit/60 per second."""
    return limit_per_minute + limit_per_minute / 60 * span_s


def send_span(records: Sequence[Record], tenant: str) -> float:
    """Seconds from a tenant's first send to its last."""
    times = [r.sent_s for r in records if r.tenant == tenant]
    return max(times) - min(times) if times else 0.0


def admitted(records: Sequence[Record], tenant: str) -> list[Record]:
    """A tenant's requests its limits let in: every one not refused with 429."""
    return [r for r in records if r.tenant == tenant and r.status != 429 and r.status != 0]


@dataclass(frozen=True, slots=True)
class Waits:
    """A tenant's answered requests as its router journaled them: how many, their time in
    the router's queue (p50, p99), and the time from arrival to the decode's first token
    less that (p50, p99): the part the engines and the router's own work took."""

    requests: int
    queue_p50_s: float
    queue_p99_s: float
    rest_p50_s: float
    rest_p99_s: float


def journal_entries(lines: Sequence[bytes]) -> list[dict[str, Any]]:
    """The request lines of a router's journal (anything else skipped)."""
    entries = []
    for line in lines:
        with contextlib.suppress(orjson.JSONDecodeError):
            entry = orjson.loads(line)
            if isinstance(entry, dict) and entry.get("type") == "request":
                entries.append(entry)
    return entries


def queue_waits(entries: Sequence[dict[str, Any]], after_s: float = 0.0) -> dict[str, Waits]:
    """Per tenant, from journal entries of answered requests; those ending in the first
    `after_s` of the journal are left out, as the clients' figures leave out the first
    sends. Entries without a tenant (a router that journals none) count for nobody."""
    first = min((e["ts"] for e in entries if is_number(e.get("ts"))), default=0.0)
    waits: dict[str, list[tuple[float, float]]] = {}
    for entry in entries:
        # The decode's first token (`first_byte_s`): `ttft_s` is the prefill's, in P/D.
        tenant, wait, ttft = (
            entry.get("tenant"),
            entry.get("queue_wait_s"),
            entry.get("first_byte_s"),
        )
        if not isinstance(tenant, str) or not isinstance(wait, int | float):
            continue
        if entry.get("status") != 200:
            continue
        if is_number(entry.get("ts")) and entry["ts"] - first < after_s:
            continue
        rest = ttft - wait if isinstance(ttft, int | float) else math.nan
        waits.setdefault(tenant, []).append((float(wait), float(rest)))
    figures = {}
    for tenant, pairs in waits.items():
        queued = [wait for wait, _ in pairs]
        after = [value for _, value in pairs if not math.isnan(value)]
        figures[tenant] = Waits(
            len(pairs),
            percentile(queued, 50) or 0.0,
            percentile(queued, 99) or 0.0,
            percentile(after, 50) or 0.0,
            percentile(after, 99) or 0.0,
        )
    return figures


def next_release_wait(ends: Sequence[float], fraction: float) -> float | None:
    """The `fraction` quantile of the wait from a moment chosen uniformly between the first
    and the last of `ends` (when requests ended, each freeing a seat) to the next end: what
    a request arriving at a saturated fleet waits for a seat when it is served at the very
    next release. Within a gap g the wait is uniform on [0, g], so the time with a wait
    over r is the sum of max(0, g - r) over the gaps; solved for r by bisection."""
    ordered = sorted(ends)
    gaps = [b - a for a, b in itertools.pairwise(ordered) if b > a]
    total = sum(gaps)
    if not total:
        return None
    low, high = 0.0, max(gaps)
    for _ in range(60):
        middle = (low + high) / 2
        over = sum(max(0.0, gap - middle) for gap in gaps) / total
        low, high = (middle, high) if over > 1 - fraction else (low, middle)
    return (low + high) / 2


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def ratio(mine: float | None, theirs: float | None) -> float | None:
    if mine is None or theirs is None or theirs == 0:
        return None
    return mine / theirs


def verdict(
    experiment: str, figure: str, value: float | None, target: str, met: bool | None
) -> Verdict:
    shown = "n/a" if value is None else f"{value:.3f}"
    return Verdict(experiment, figure, shown, target, None if value is None else met)


def format_verdicts(verdicts: Sequence[Verdict]) -> str:
    header = f"{'experiment':<11}{'figure':<52}{'value':>10}  {'target':<18}{'met':>5}"
    lines = [header, "-" * len(header)]
    for v in verdicts:
        met = "n/a" if v.met is None else ("yes" if v.met else "NO")
        lines.append(f"{v.experiment:<11}{v.figure:<52}{v.value:>10}  {v.target:<18}{met:>5}")
    return "\n".join(lines)


def stats_line(stats: TenantStats) -> str:
    p50 = "-" if stats.ttft_p50_s is None else f"{stats.ttft_p50_s * 1000:.0f}"
    p99 = "-" if stats.ttft_p99_s is None else f"{stats.ttft_p99_s * 1000:.0f}"
    refused = ", ".join(f"{n} x {s}" for s, n in sorted(stats.refused.items())) or "none"
    return (
        f"{stats.tenant}: {stats.requests} sent, {stats.ok} answered, refused {refused}, "
        f"{stats.failed} failed; goodput {stats.goodput_rps:.2f}/s; TTFT p50 {p50} ms, "
        f"p99 {p99} ms; {stats.tokens_served:,} tokens served"
    )


def at_least(value: float | None, bound: float) -> bool:
    return value is not None and value >= bound


def at_most(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound


def near(value: float | None, within: float = 0.02) -> bool:
    return value is not None and abs(value - 1) <= within

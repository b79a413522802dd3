"""The last few minutes of finished requests, for the fleet page.

Fed once per request; memory is bounded by time buckets for counts and by a fixed number
of latency samples, so a busy router keeps the percentiles of its latest requests. With
`[[tenants]]`, each tenant's requests are counted by outcome too, and its refusals.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from narwhal.runtime.ranks import nearest_rank

if TYPE_CHECKING:
    from narwhal.router.call import Call

WINDOW_S = 300.0
BUCKET_S = 10.0
MAX_SAMPLES = 2048
# Counted per tenant beside its outcomes (no outcome is spelt so).
REFUSED = "refused"


class RecentCalls:
    """Outcome counts per `bucket_s` and recent latencies, over `window_s`."""

    def __init__(
        self, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S, max_samples: int = MAX_SAMPLES
    ) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        # (bucket number, outcome counts, handoff kinds, (tenant, outcome or "refused")
        # counts), oldest first.
        self._buckets: deque[tuple[int, Counter[str], Counter[str], Counter[tuple[str, str]]]] = (
            deque(maxlen=math.ceil(window_s / bucket_s) + 1)
        )
        # (end time, ttft_s, first_byte_s) of requests that reached those points.
        self._samples: deque[tuple[float, float | None, float | None]] = deque(maxlen=max_samples)

    def add(self, call: Call, now: float) -> None:
        number = int(now // self.bucket_s)
        if not self._buckets or self._buckets[-1][0] != number:
            self._buckets.append((number, Counter(), Counter(), Counter()))
        bucket = self._buckets[-1]
        bucket[1][call.outcome] += 1
        if call.handoff is not None:
            bucket[2][call.handoff] += 1
        if call.tenant is not None:
            bucket[3][call.tenant, call.outcome] += 1
            if call.refusal is not None:
                bucket[3][call.tenant, REFUSED] += 1
        if call.ttft_s is not None:
            self._samples.append((now, call.ttft_s, call.first_byte_s))

    def summary(self, now: float) -> dict[str, Any]:
        """Rate, outcomes, handoff kinds, ttft and first-byte percentiles, and a per-bucket
        series; with tenants, `tenants`: each tenant's requests, outcomes and refusals."""
        current = int(now // self.bucket_s)
        first = current - math.ceil(self.window_s / self.bucket_s) + 1
        counts = {number: outcomes for number, outcomes, _, _ in self._buckets if number >= first}
        outcomes: Counter[str] = Counter()
        for bucket in counts.values():
            outcomes.update(bucket)
        handoffs: Counter[str] = Counter()
        by_tenant: Counter[tuple[str, str]] = Counter()
        for number, _, kinds, tenants in self._buckets:
            if number >= first:
                handoffs.update(kinds)
                by_tenant.update(tenants)
        total = sum(outcomes.values())
        # The rate covers the time since the window's first request, at least one bucket.
        oldest = min(counts, default=current) * self.bucket_s
        span = max(self.bucket_s, now - oldest)
        since = now - self.window_s
        samples = [s for s in self._samples if s[0] >= since]
        summary: dict[str, Any] = {
            "window_s": self.window_s,
            "bucket_s": self.bucket_s,
            "requests": total,
            "rate_per_s": round(total / span, 3),
            "outcomes": dict(outcomes),
            # How requests were served: crossed, recomputed, same_worker, fallback.
            "handoffs": dict(handoffs),
            "ttft_s": percentiles([s[1] for s in samples if s[1] is not None]),
            "first_byte_s": percentiles([s[2] for s in samples if s[2] is not None]),
            "series": [
                {"ago_s": (current - number) * self.bucket_s, **counts.get(number, {})}
                for number in range(first, current + 1)
            ],
        }
        if by_tenant:
            summary["tenants"] = _tenants(by_tenant)
        return summary


def _tenants(counts: Counter[tuple[str, str]]) -> dict[str, Any]:
    """Per tenant: its requests, their outcomes, and how many were refused (429 or 503,
    with a `Call.refusal`)."""
    tenants: dict[str, Any] = {}
    for (tenant, word), count in sorted(counts.items()):
        entry = tenants.setdefault(tenant, {"requests": 0, "outcomes": {}, "refused": 0})
        if word == REFUSED:
            entry["refused"] += count
        else:
            entry["requests"] += count
            entry["outcomes"][word] = count
    return tenants


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50, p90 and p99 by nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return {f"p{q}": round(nearest_rank(ordered, q), 4) for q in (50, 90, 99)}

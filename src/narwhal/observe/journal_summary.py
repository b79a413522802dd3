"""`narwhal journal summarize FILE`: what a journal says, for a person after an incident.

Reads request lines and engine lines (other or broken lines are counted and skipped, so a
journal cut off mid-line by a crash still summarizes) and prints requests by outcome and
status, latency percentiles, retries, handoff kinds and each engine's failures and state
changes.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from narwhal.runtime.ranks import nearest_rank

LATENCIES = (
    ("ttft_s", "ttft"),
    ("first_byte_s", "first byte"),
    ("queue_wait_s", "queue wait"),
    ("prefill_s", "prefill leg"),
    ("decode_s", "decode leg"),
    ("duration_s", "duration"),
)


@dataclass
class Summary:
    """Counts gathered from one pass over a journal."""

    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    causes: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    retried: int = 0
    retries: int = 0
    retry_denied: int = 0
    handoffs: Counter[str] = field(default_factory=Counter)
    failures: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    changes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    skipped: int = 0
    first_ts: float | None = None
    last_ts: float | None = None

    def add(self, line: dict[str, Any]) -> None:
        kind = line.get("type")
        if kind == "request":
            self._request(line)
        elif kind == "engine":
            event = str(line.get("event"))
            if line.get("result"):
                event = f"{event} {line['result']}"
            self.changes[str(line.get("engine"))][event] += 1
        else:
            self.skipped += 1
            return
        ts = line.get("ts")
        if isinstance(ts, int | float):
            self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
            self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)

    def _request(self, line: dict[str, Any]) -> None:
        self.requests += 1
        self.outcomes[str(line.get("outcome"))] += 1
        self.statuses[int(line.get("status") or 0)] += 1
        if line.get("cause"):
            self.causes[str(line["cause"])] += 1
        for key, _ in LATENCIES:
            value = line.get(key)
            if isinstance(value, int | float):
                self.latencies[key].append(float(value))
        attempts = int(line.get("attempts") or 0)
        if attempts > 1:
            self.retried += 1
            self.retries += attempts - 1
        self.retry_denied += bool(line.get("retry_denied"))
        if line.get("handoff"):
            self.handoffs[str(line["handoff"])] += 1
        for failure in line.get("failures") or ():
            if isinstance(failure, dict) and failure.get("engine"):
                self.failures[str(failure["engine"])][str(failure.get("cause"))] += 1


def read_summary(lines: Iterable[bytes]) -> Summary:
    summary = Summary()
    for raw in lines:
        if not raw.strip():
            continue
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            summary.skipped += 1
            continue
        if isinstance(line, dict):
            summary.add(line)
        else:
            summary.skipped += 1
    return summary


def render(summary: Summary) -> str:
    out: list[str] = []
    if summary.first_ts is not None and summary.last_ts is not None:
        span = summary.last_ts - summary.first_ts
        out.append(f"from {_when(summary.first_ts)} to {_when(summary.last_ts)} ({span:.0f} s)")
    out.append(f"requests: {summary.requests}")
    out.append(_counts("  by outcome", summary.outcomes))
    out.append(_counts("  by status", Counter({str(k): v for k, v in summary.statuses.items()})))
    if summary.causes:
        out.append(_counts("  failure causes", summary.causes))
    out.append("")
    out.append(f"{'latency':<12}{'n':>7}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in LATENCIES:
        values = sorted(summary.latencies.get(key, ()))
        if values:
            cells = "".join(f"{_seconds(nearest_rank(values, q)):>10}" for q in (50, 90, 99))
            out.append(f"{label:<12}{len(values):>7}{cells}")
    out.append("")
    out.append(
        f"retries: {summary.retries} over {summary.retried} requests; "
        f"{summary.retry_denied} denied by the retry budget"
    )
    out.append(_counts("handoffs", summary.handoffs))
    engines = sorted(set(summary.failures) | set(summary.changes))
    if engines:
        out.append("")
        out.append("engines:")
        for engine in engines:
            out.append(f"  {engine}")
            if summary.failures.get(engine):
                out.append(_counts("    failures", summary.failures[engine]))
            if summary.changes.get(engine):
                out.append(_counts("    state changes", summary.changes[engine]))
    if summary.skipped:
        out.append("")
        out.append(f"skipped {summary.skipped} lines that are not journal entries")
    return "\n".join(out)


def _counts(label: str, counts: Counter[str]) -> str:
    if not counts:
        return f"{label}: none"
    return f"{label}: " + ", ".join(f"{key} {n}" for key, n in counts.most_common())


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def summarize_command(path: Path) -> int:
    """Print the summary of the journal at `path`; exit status 2 if it cannot be read."""
    try:
        with path.open("rb") as handle:
            summary = read_summary(handle)
    except OSError as error:
        print(f"cannot read the journal {path}: {error.strerror}", file=sys.stderr)
        return 2
    print(render(summary))
    return 0

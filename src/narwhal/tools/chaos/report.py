"""A soak's report: what it measured, and what each check found."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from narwhal.tools.chaos.checks import (
    AbandonedTotals,
    abandoned_problems,
    check_leaks,
    check_service,
    continuation_problems,
)
from narwhal.tools.chaos.memory import Trend
from narwhal.tools.chaos.options import ChaosOptions
from narwhal.tools.chaos.tally import Problems, Tally


@dataclass
class Report:
    """Everything a run measured, and what each check found."""

    options: ChaosOptions
    tally: Tally
    duration_s: float = 0.0
    faults: Counter[str] = field(default_factory=Counter)
    state: dict[str, Any] = field(default_factory=dict)
    trend: Trend | None = None
    unhandled: Problems = field(default_factory=Problems)
    # The router's abandoned-handoff counters per producer, read once the load was over.
    abandoned: dict[str, AbandonedTotals] | None = None

    @property
    def checks(self) -> dict[str, Problems]:
        leaks, service, memory = Problems(), Problems(), Problems()
        unsettled = ["the router's state was never read"]
        leaks.add(check_leaks(self.state) if self.state else unsettled)
        service.add(check_service(self.state) if self.state else unsettled)
        if self.trend is None or not self.trend.stable:
            memory.add(["RSS grew past its bound"])
        continued = Problems()
        cut = self.tally.cut
        continued.add(continuation_problems(cut["continued"], cut["failed"]))
        abandoned = Problems()
        if self.abandoned is None:
            abandoned.add(["the router's metrics were never read"])
        else:
            abandoned.add(abandoned_problems(self.tally.abandoned, self.abandoned))
        checks = {
            "one outcome per request": self.tally.once,
            "statuses follow the rules": self.tally.rules,
            "no 503 for lack of an engine while one accepts connections": self.tally.no_engine,
            "clients saw what the journal says": self.tally.views,
            "every complete answer's text, nothing lost or doubled": self.tally.texts,
            "cut answers that could continue were continued (99 %)": continued,
            "nothing left in flight": leaks,
            "every engine back in service": service,
            "abandoned handoffs in the journal match the metrics": abandoned,
            "memory stable": memory,
            "no unhandled exception": self.unhandled,
        }
        if self.options.controller:
            checks["role moves kept pins and floors"] = self.tally.roles
        return checks

    @property
    def ok(self) -> bool:
        return not any(problems.count for problems in self.checks.values())


def format_report(report: Report) -> str:
    """The figures first, then one PASS or FAIL line per check with its first problems."""
    options, tally = report.options, report.tally
    out = [
        f"narwhal chaos: seed {options.seed}, {options.prefill} prefill + {options.decode} "
        f"decode engines, {tally.requests} requests from {options.concurrency} clients "
        f"in {report.duration_s:.1f} s",
        f"faults injected ({sum(report.faults.values())}):",
    ]
    out += [f"  {kind:<22}{count:>8}" for kind, count in sorted(report.faults.items())]
    out.append(f"outcomes ({tally.lines} journal lines, {tally.retried} after a retry):")
    out += [
        f"  {status} {cause:<20}{n:>7}" for (status, cause), n in sorted(tally.outcomes.items())
    ]
    unavailable = tally.unavailable
    out.append(f"429 and 503 answers by reason ({sum(unavailable.values())}):")
    out += [f"  {status} {reason:<36}{n:>7}" for (status, reason), n in sorted(unavailable.items())]
    out.append(
        f"clients: {tally.left} left part-way ({tally.closed} journaled as 499), "
        f"{tally.terminal} streams ended with a terminal error event"
    )
    out.append(
        f"continuation: of the answers cut mid-way, {tally.cut['continued']} ended complete, "
        f"{tally.cut['failed']} did not though they could have been continued, "
        f"{tally.cut['excused']} could not be ({_excuses(tally.cut_excuses)})"
    )
    abandoned = tally.abandoned
    out.append(
        f"abandoned handoffs: {sum(a.handoffs for a in abandoned.values())} "
        f"({sum(a.blocks for a in abandoned.values())} blocks, "
        f"{sum(a.block_seconds for a in abandoned.values()):.1f} block-seconds)"
        + "".join(f", {p} {a.handoffs}" for p, a in sorted(abandoned.items()))
    )
    state = report.state
    seats = sum(
        engine["seats"][phase]["in_use"]
        for engine in state.get("engines", [])
        for phase in ("prefill", "decode")
    )
    out.append(
        f"left over: in flight {state.get('in_flight')}, queued {state.get('queued')}, "
        f"open engine legs {state.get('open_engine_legs')}, seats in use {seats}"
    )
    trend = report.trend
    if trend is not None:
        out.append(
            f"memory after warm-up: RSS {trend.start_mb:.1f} -> {trend.end_mb:.1f} MB over "
            f"{trend.samples} samples, trend {trend.slope_mb_per_min:+.2f} MB/min, "
            f"growth {trend.growth_mb:+.1f} MB (bound {trend.bound_mb:.0f} MB)"
        )
    if options.controller:
        out.append(f"role controller moves: {tally.moves}")
    out.append(f"unhandled exceptions: {report.unhandled.count}")
    out.append("checks:")
    for name, problems in report.checks.items():
        out.append(f"  {'FAIL' if problems.count else 'PASS'} {name}")
        out += [f"       {problem}" for problem in problems.shown]
        if problems.count > len(problems.shown):
            out.append(f"       ... and {problems.count - len(problems.shown)} more")
    return "\n".join(out)


# How the report names each excuse (`checks.cut_excuse`).
_EXCUSE_NAMES = {
    "answer": "the request's features or the answer as cut",
    "fleet": "no other consumer",
    "budget": "budget or max_attempts spent",
    "deadline": "deadline",
    "client left": "client left",
}


def _excuses(excuses: Counter[str]) -> str:
    if not excuses:
        return "none"
    return ", ".join(f"{_EXCUSE_NAMES.get(k, k)} {n}" for k, n in excuses.most_common())

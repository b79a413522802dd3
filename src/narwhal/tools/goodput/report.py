"""The goodput results as a table, a JSON document and (with matplotlib) a chart."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from narwhal.tools.goodput.score import ALL, PhaseStats, best_split

if TYPE_CHECKING:
    from narwhal.tools.goodput.replay import SplitRun


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(results: Mapping[int, Mapping[str, PhaseStats]], engines: int) -> str:
    """One row per split and phase: goodput, then TTFT and TPOT p50/p90/p99 in ms."""
    header = (
        f"{'split':>6} {'phase':<21} {'reqs':>5} {'good':>5} {'goodput/s':>9}  "
        f"{'TTFT p50/p90/p99 ms':>21}  {'TPOT p50/p90/p99 ms':>19}"
    )
    lines = [header, "-" * len(header)]
    for prefill, phases in sorted(results.items()):
        for phase, stats in phases.items():
            ttft = "/".join(_ms(v) for v in (stats.ttft_s.p50, stats.ttft_s.p90, stats.ttft_s.p99))
            tpot = "/".join(_ms(v) for v in (stats.tpot_s.p50, stats.tpot_s.p90, stats.tpot_s.p99))
            lines.append(
                f"{f'{prefill}P{engines - prefill}D':>6} {phase:<21} {stats.requests:>5} "
                f"{stats.good:>5} {stats.goodput_rps:>9.2f}  {ttft:>21}  {tpot:>19}"
            )
    lines.append("")
    for phase in phases_of(results):
        best = best_split(results, phase)
        if best is not None:
            lines.append(f"best static split for {phase}: {best}P{engines - best}D")
    return "\n".join(lines)


def phases_of(results: Mapping[int, Mapping[str, PhaseStats]]) -> list[str]:
    """Every phase seen, `all` first."""
    seen: list[str] = [ALL]
    for phases in results.values():
        seen += [phase for phase in phases if phase not in seen]
    return seen


def best_by_phase(results: Mapping[int, Mapping[str, PhaseStats]]) -> dict[str, int | None]:
    return {phase: best_split(results, phase) for phase in phases_of(results)}


def plot(results: Mapping[int, Mapping[str, PhaseStats]], engines: int, path: Path) -> str | None:
    """Goodput per split, one line per phase; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no chart"
    splits = sorted(results)
    figure, axes = plt.subplots(figsize=(7, 4))
    for phase in phases_of(results):
        values = [results[k][phase].goodput_rps if phase in results[k] else 0 for k in splits]
        axes.plot(splits, values, marker="o", label=phase)
    axes.set_xticks(splits, [f"{k}P{engines - k}D" for k in splits])
    axes.set_xlabel("static split")
    axes.set_ylabel("goodput (requests/s meeting both SLOs)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return None


def document(
    meta: Mapping[str, Any],
    results: Mapping[int, Mapping[str, PhaseStats]],
    runs: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The JSON written by `narwhal goodput --out`."""
    return {
        **meta,
        "splits": [
            {
                **run,
                "phases": {phase: s.to_json() for phase, s in results[run["prefill"]].items()},
            }
            for run in runs
        ],
        "best": best_by_phase(results),
    }


def controller_document(
    run: SplitRun,
    stats: Mapping[str, PhaseStats],
    results: Mapping[int, Mapping[str, PhaseStats]],
    speed: float = 1.0,
) -> dict[str, Any]:
    """The controller run in the JSON report: its phases, its moves (each with `at_s`, its
    time in trace seconds since the replay began), and its goodput over the best static
    split's, overall and per phase."""
    summary = run.controller or {}
    timeline = [
        {**move, "at_s": round((move["ts"] - run.started_at) * speed, 1)}
        if "ts" in move and run.started_at
        else dict(move)
        for move in summary.get("timeline", [])
    ]
    versus: dict[str, float | None] = {}
    for phase, mine in stats.items():
        best = best_split(results, phase)
        theirs = results[best][phase].goodput_rps if best is not None else 0.0
        versus[phase] = round(mine.goodput_rps / theirs, 3) if theirs else None
    return {
        "start": {"prefill": run.prefill, "decode": run.decode},
        "wall_s": round(run.wall_s, 2),
        **(run.start or {}),
        "phases": {phase: s.to_json() for phase, s in stats.items()},
        "vs_best_static": versus,
        "moves": summary.get("moves", {}),
        "timeline": timeline,
        "final_split": summary.get("split"),
        # Why it held at the end when it did not move (e.g. "donor_slo").
        "last_decision": summary.get("last_decision"),
    }


def controller_table(
    doc: Mapping[str, Any], results: Mapping[int, Mapping[str, PhaseStats]], engines: int
) -> str:
    """The controller run's goodput and latencies per phase beside the best static
    split's goodput."""
    start = doc["start"]
    header = (
        f"{'phase':<21} {'reqs':>5} {'good':>5} {'goodput/s':>9}  {'TTFT p50/p99 ms':>15}  "
        f"{'TPOT p50/p99':>12}  {'best static':>18}  {'ratio':>5}"
    )
    lines = [
        f"role controller, starting from {start['prefill']}P{start['decode']}D:",
        header,
        "-" * len(header),
    ]
    for phase, stats in doc["phases"].items():
        best = best_split(results, phase)
        best_text = (
            f"{best}P{engines - best}D {results[best][phase].goodput_rps:.2f}"
            if best is not None
            else "-"
        )
        ratio = doc["vs_best_static"].get(phase)
        ttft = "/".join(_ms(stats["ttft_s"][q]) for q in ("p50", "p99"))
        tpot = "/".join(_ms(stats["tpot_s"][q]) for q in ("p50", "p99"))
        lines.append(
            f"{phase:<21} {stats['requests']:>5} {stats['good']:>5} "
            f"{stats['goodput_rps']:>9.2f}  {ttft:>15}  {tpot:>12}  {best_text:>18}  "
            f"{'n/a' if ratio is None else f'{ratio:.2f}x':>5}"
        )
    if None in doc["vs_best_static"].values():
        lines.append("n/a: no static split served a request within both SLOs there")
    moves = ", ".join(
        (f"{m['at_s']:.1f} s " if "at_s" in m else "")
        + f"{m['engine']} {m['from']}->{m['to']} ({m['reason']})"
        for m in doc["timeline"]
    )
    lines.append(f"moves ({len(doc['timeline'])}): {moves or 'none'}")
    return "\n".join(lines)

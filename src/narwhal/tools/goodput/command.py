"""`narwhal goodput`: replay a trace over every static split of N engines and compare them.

    narwhal goodput --engines 6 --profile llama-3.1-8b-h100 --trace shifting --duration 60

For each split (1..N-1 prefill engines, the rest decode) a router is started over the same
simulated engines and the trace is replayed through it; the table and the JSON report
goodput (requests per second meeting both the TTFT and the TPOT SLO) and TTFT/TPOT
percentiles per trace phase, and the best split overall and per phase. Then, on the same
engines and trace, a router with the role controller on, starting from the middle split,
is scored the same way beside them (`--no-controller` skips it).

With `--tenant NAME:KEY=VALUE,...` flags (`narwhal.tools.goodput.tenants`) each tenant is a
`[[tenants]]` entry of every router and a trace of its own (its `shape`, else `--trace`,
at its `rate`), sent with its key; the merged trace is replayed and each split also gets
one row per tenant. A JSONL trace may name each request's tenant (`tenant`); its tenants'
flags then give their settings and keys, and need no rate.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from narwhal.tools.goodput.capacity import suggested_rate
from narwhal.tools.goodput.replay import (
    KV_LEASE_S,
    FleetProcess,
    SplitRun,
    controller_sections,
    run_split,
)
from narwhal.tools.goodput.report import (
    controller_document,
    controller_table,
    document,
    plot,
    table,
)
from narwhal.tools.goodput.score import (
    ALL,
    Outcome,
    PhaseStats,
    Slo,
    default_slo,
    split_stats,
    steady_stats,
)
from narwhal.tools.goodput.tenants import (
    TenantLoad,
    TenantStats,
    check_tenants,
    format_stats,
    outcome_record,
    parse_tenant,
    stats_json,
    tenant_stats,
)
from narwhal.tools.goodput.traces import (
    SHAPES,
    TraceRequest,
    generate,
    parse_jsonl,
    phase_durations,
    phase_runs,
)
from narwhal.tools.sim.options import profile_options
from narwhal.tools.sim.profiles import PROFILES


def add_goodput_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--engines", type=int, default=4, help="simulated engines (2 or more; 4-8 is typical)")
    add("--profile", default="llama-3.1-8b-h100", choices=sorted(PROFILES), help="engine timing")
    add("--trace", default="shifting", help=f"a shape ({', '.join(SHAPES)}) or a JSONL file")
    add("--duration", type=float, default=60.0, help="trace seconds (shapes only)")
    add("--rate", type=float, help="requests/s (shapes only; default: ~80%% of capacity)")
    add("--cycles", type=int, default=2, help="how often a shape repeats its phases")
    add("--token-scale", type=float, default=1.0, help="scale every prompt and output length")
    add("--seed", type=int, default=0, help="fixes the trace")
    add("--speed", type=float, default=1.0, help="replay this many times faster (engines too)")
    add("--splits", help="prefill counts to try, e.g. 1,3 (default: 1..N-1)")
    add("--slo-ttft", type=float, help="TTFT SLO in seconds (default: from the profile)")
    add("--slo-tpot", type=float, help="TPOT SLO in seconds (default: from the profile)")
    add(
        "--no-controller",
        dest="controller",
        action="store_false",
        help="skip the role controller run",
    )
    add(
        "--settle",
        type=float,
        default=10.0,
        help="trace seconds after each phase starts left out of its 'steady' figures",
    )
    add(
        "--tenant",
        type=_tenant,
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="a tenant: its [[tenants]] keys and its trace (rate=R, shape=S); repeatable",
    )
    add("--out", type=Path, default=Path("goodput.json"), help="JSON report")
    add("--plot", type=Path, help="also draw a PNG chart (needs matplotlib)")


def _tenant(text: str) -> TenantLoad:
    try:
        return parse_tenant(text, load_required=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_trace(args: argparse.Namespace) -> tuple[list[TraceRequest], float]:
    """The trace and its length in seconds."""
    tenants: list[TenantLoad] = getattr(args, "tenant", [])
    check_tenants(tenants)
    if args.trace not in SHAPES:
        requests = parse_jsonl(Path(args.trace).read_text())
        duration = max((r.arrival_s for r in requests), default=0.0) or 1.0
        named = {tenant.name for tenant in tenants}
        strangers = sorted({r.tenant for r in requests if r.tenant and r.tenant not in named})
        if strangers:
            raise ValueError(f"the trace names tenants without a --tenant flag: {strangers}")
        return requests, duration
    if tenants:
        return tenant_trace(args, tenants), args.duration
    costs = profile_options(args.profile).step_costs
    rate = (
        args.rate
        if args.rate is not None
        else (lambda mix: suggested_rate(costs, args.engines, mix))
    )
    trace = generate(
        args.trace,
        seed=args.seed,
        duration_s=args.duration,
        rate=rate,
        cycles=args.cycles,
        token_scale=args.token_scale,
    )
    return trace, args.duration


def tenant_trace(args: argparse.Namespace, tenants: list[TenantLoad]) -> list[TraceRequest]:
    """Each tenant's trace (its shape, else `--trace`, at its rate), merged. Phases are
    kept when every tenant has the same shape (their windows then coincide); otherwise
    every request is of phase `all`, and the tenants' rows say the rest."""
    shapes = {tenant.shape or args.trace for tenant in tenants}
    merged: list[TraceRequest] = []
    for index, tenant in enumerate(tenants):
        shape = tenant.shape or args.trace
        if tenant.rate is None or shape not in SHAPES:
            raise ValueError(
                f"--tenant {tenant.name}: a trace needs rate=R and a shape of "
                f"{', '.join(SHAPES)} (got shape {shape!r})"
            )
        trace = generate(
            shape,
            seed=args.seed + index,
            duration_s=args.duration,
            rate=tenant.rate,
            cycles=args.cycles,
            token_scale=args.token_scale,
        )
        merged += [
            replace(
                request,
                tenant=tenant.name,
                prompt_tokens=tenant.prompt_tokens or request.prompt_tokens,
                output_tokens=tenant.max_tokens or request.output_tokens,
                phase=request.phase if len(shapes) == 1 else ALL,
            )
            for request in trace
        ]
    return sorted(merged, key=lambda request: request.arrival_s)


def tenants_of(
    tenants: list[TenantLoad], outcomes: list[Outcome], slo: Slo, duration_s: float
) -> list[TenantStats]:
    """Each tenant's row of a split (times in trace seconds)."""
    records = [outcome_record(outcome) for outcome in outcomes]
    return [
        tenant_stats(tenant.name, records, window=(0.0, duration_s + 1e-6), slo=slo)
        for tenant in tenants
    ]


def splits_of(text: str | None, engines: int) -> list[int]:
    if text is None:
        return list(range(1, engines))
    splits = sorted({int(part) for part in text.split(",") if part.strip()})
    if not splits or splits[0] < 1 or splits[-1] > engines - 1:
        raise ValueError(f"--splits: each prefill count must be in 1..{engines - 1}")
    return splits


Results = dict[int, dict[str, PhaseStats]]


async def goodput(args: argparse.Namespace) -> tuple[Results, dict[str, Any]]:
    """Run every split; returns the stats by split and phase, and the JSON document."""
    if args.engines < 2:
        raise ValueError("--engines: need at least 2 (a prefill and a decode engine)")
    if not args.speed > 0:
        raise ValueError("--speed: must be more than 0")
    splits = splits_of(args.splits, args.engines)
    trace, duration = load_trace(args)
    if not trace:
        raise ValueError("the trace has no requests")
    options = profile_options(args.profile)
    slo = default_slo(options.step_costs, options.request_overhead_s)
    slo = Slo(args.slo_ttft or slo.ttft_s, args.slo_tpot or slo.tpot_s)
    durations = phase_durations(trace, duration)
    phase_spans = phase_runs(trace, duration)

    def stats_of(outcomes: list[Outcome]) -> dict[str, PhaseStats]:
        return {
            **split_stats(outcomes, slo, durations),
            **steady_stats(outcomes, slo, phase_spans, args.settle),
        }

    tenants: list[TenantLoad] = getattr(args, "tenant", [])
    by_tenant: dict[str, list[TenantStats]] = {}
    results: Results = {}
    runs: list[dict[str, Any]] = []
    controlled: dict[str, PhaseStats] | None = None
    control_run: SplitRun | None = None
    fields = {"profile": args.profile, "speed": args.speed, "kv_lease_s": KV_LEASE_S}
    start = args.engines // 2
    async with FleetProcess(args.engines, fields) as fleet:
        for prefill, controller in run_order(splits, start, getattr(args, "controller", True)):
            sections = controller_sections(slo, args.speed) if controller else None
            run = await run_split(
                fleet, prefill, trace, args.speed, controller=sections, tenants=tenants
            )
            label = f"{start}P{args.engines - start}D controller" if controller else None
            label = label or f"{run.prefill}P{run.decode}D"
            if tenants:
                by_tenant[label] = tenants_of(tenants, run.outcomes, slo, duration)
            if controller:
                control_run, controlled = run, stats_of(run.outcomes)
                _progress(f"controller from {start}P{args.engines - start}D", run)
                continue
            results[prefill] = stats_of(run.outcomes)
            runs.append(
                {
                    "prefill": run.prefill,
                    "decode": run.decode,
                    "wall_s": round(run.wall_s, 2),
                    "engine_cpu_s": round(run.engine_cpu_s, 2),
                    "router_client_cpu_s": round(run.router_client_cpu_s, 2),
                    **(run.start or {}),
                }
            )
            _progress(f"split {run.prefill}P{run.decode}D", run)
    meta = {
        "profile": args.profile,
        "engines": args.engines,
        "trace": args.trace,
        "seed": args.seed,
        "requests": len(trace),
        "duration_s": duration,
        "speed": args.speed,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "phase_durations_s": durations,
        "settle_s": args.settle,
    }
    report = document(meta, results, runs)
    if by_tenant:
        report["tenants"] = {
            label: [stats_json(stats) for stats in rows] for label, rows in by_tenant.items()
        }
        report["tenant_table"] = "\n\n".join(
            f"{label}:\n{format_stats(rows)}" for label, rows in by_tenant.items()
        )
    if controlled is not None and control_run is not None:
        report["controller"] = controller_document(control_run, controlled, results, args.speed)
    return results, report


def run_order(splits: list[int], start: int, controller: bool) -> list[tuple[int, bool]]:
    """(prefill count, controller?) in the order run: the controller run, if any, in the
    middle of the static splits, so that a machine whose other load drifts during the
    experiment favours neither side."""
    order = [(prefill, False) for prefill in splits]
    if controller:
        order.insert(len(splits) // 2, (start, True))
    return order


def _progress(what: str, run: SplitRun) -> None:
    waited = run.start or {}
    print(
        f"{what}: {run.wall_s:.1f} s wall, engines {run.engine_cpu_s:.1f} s CPU, "
        f"router+client {run.router_client_cpu_s:.1f} s CPU; waited "
        f"{waited.get('idle_wait_s', 0.0):.1f} s for idle engines"
        f"{' (restarted them)' if waited.get('restarted') else ''}",
        file=sys.stderr,
        flush=True,
    )


async def goodput_command(args: argparse.Namespace) -> int:
    try:
        results, report = await goodput(args)
    except (ValueError, OSError) as exc:
        print(f"narwhal goodput: {exc}", file=sys.stderr)
        return 2
    slo = report["slo"]
    print(
        f"{report['requests']} requests over {report['duration_s']:.0f} s of trace "
        f"({report['trace']}, seed {report['seed']}), {report['engines']} engines "
        f"({report['profile']}), speed {report['speed']}; SLO TTFT <= "
        f"{slo['ttft_s'] * 1000:.0f} ms, TPOT <= {slo['tpot_s'] * 1000:.1f} ms\n"
    )
    print(table(results, args.engines))
    tenant_table = report.pop("tenant_table", None)
    if tenant_table is not None:
        print("\nby tenant (goodput: answered within both SLOs, per trace second):\n")
        print(tenant_table)
    if "controller" in report:
        print("\n" + controller_table(report["controller"], results, args.engines))
    args.out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"\nJSON report: {args.out}")
    if args.plot is not None:
        why_not = plot(results, args.engines, args.plot)
        print(why_not or f"chart: {args.plot}")
    return 0

"""Issue 28's "Done when" experiments for tenants, on a simulated 1P+1D fleet, with their figures.

    .venv/bin/python benchmarks/tenant_experiments.py [--only isolation,weights,priority,limits,cpu]
        [--profile llama-3.1-8b-h100] [--decode-seats 32] [--json out.json]

The fleet is one producer and one consumer `narwhal sim` with a profile's step times; the
consumer's seats (the router's `max_decode_seats`, the engine's `max_num_seqs`) bound what
runs, so load past the fleet's capacity waits in the router's queue, where the tenants'
scheduler orders it. First a calibration measures that capacity (requests/s with the
fleet saturated by a closed loop); then, each experiment over the same fleet and a router
started for it (`tenant_bench`), every tenant's load in a load process of its own:

- isolation: tenant B at light load alone, then beside tenant A flooding at ten times the
  capacity, open loop (Poisson), equal weights and settings; B's goodput (the profile's
  SLOs) and TTFT p99 with the flood over alone. Target: goodput >= 95 %, p99 <= 2x.
- weights: two tenants at weights 3:1, each a closed loop able to fill the fleet alone;
  tokens served (prompt + completion of answers ending in the window) over 60 s after a
  warm-up. Target: 3:1 within +-10 %.
- priority: band 0 at light load alone, then beside band 1 flooding at ten times the
  capacity; band 0's TTFT p99 with the flood over alone, its refusals, band 1's. Target:
  p99 <= 1.5x, no band-0 request refused, band 1 refused.
- limits: a requests_per_minute tenant and a tokens_per_minute tenant each sending three
  times what its limit allows at fixed intervals; admitted (not answered 429) against what
  the bucket allows over the span of its sends (limit + limit/60 per second); with one
  router process and with `--workers 2`. Beside them one client per limit that honours each
  refusal's Retry-After (a closed loop of one). Target: within 2 %; every return admitted.
- cpu: the bench's own fleet (engines answering at once, unlimited seats) and load, two
  routers interleaved in one run: no tenants, and one default tenant with no limits (and
  a second router without tenants, to show the run's noise). Target: router CPU per
  request within 3 %.

Every figure is printed as it is taken, then a summary of figures against targets.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvloop
from tenant_bench import DEFAULT_PROFILE, FleetShape, LoadRun, TenantFleet, tenant_fleet
from tenant_cpu import no_tenants_cpu
from tenant_figures import (
    Verdict,
    admitted,
    at_least,
    at_most,
    bucket_allows,
    capacity_rps,
    format_verdicts,
    is_number,
    journal_entries,
    near,
    next_release_wait,
    queue_waits,
    ratio,
    send_span,
    stats_line,
    verdict,
)
from workers_bench import requests_by_worker

from narwhal.tools.goodput.tenants import TenantLoad, TenantStats, stats_json
from narwhal.tools.sim.profiles import PROFILES

EXPERIMENTS = ("isolation", "weights", "priority", "limits", "cpu")


@dataclass(frozen=True, slots=True)
class Plan:
    """Every experiment's knobs."""

    shape: FleetShape = field(default_factory=FleetShape)
    seed: int = 0
    calibrate_s: float = 12.0
    # Light load (B, band 0) as a share of the capacity; the flood as a multiple of it.
    light_share: float = 0.1
    flood_factor: float = 10.0
    # Isolation and priority: each run's length; figures from sends after `settle_s`.
    run_s: float = 30.0
    settle_s: float = 5.0
    # Isolation: both tenants' TTFT objective (None: none; then only the queue bounds A).
    objective_s: float | None = None
    # `[tenants_policy] reserved_seats` on every router (0: none held back).
    reserved_seats: int = 0
    weights_s: float = 60.0
    weights_warm_s: float = 10.0
    limits_s: float = 40.0
    # Limits: requests per minute, tokens per minute, and the load sent past each.
    rpm: float = 600.0
    tpm: float = 60_000.0
    over: float = 3.0
    # Retry-After clients: their limits, and their requests' output (short, so a closed
    # loop of one drains its bucket soon).
    retry_rpm: float = 30.0
    retry_tpm: float = 4_080.0
    retry_max_tokens: int = 8
    cpu_requests: int = 2000
    cpu_trials: int = 5
    # cpu: another tree's `src` (e.g. `git archive` of the commit before) as a target too.
    baseline: Path | None = None


# --- The experiments ------------------------------------------------------------------------


class Experiments:
    """The runs, over one fleet; figures and verdicts gathered as they are taken."""

    def __init__(self, running: TenantFleet, plan: Plan) -> None:
        self.running = running
        self.plan = plan
        self.slo = plan.shape.slo()
        self.verdicts: list[Verdict] = []
        self.figures: dict[str, Any] = {}
        self.capacity: float | None = None

    async def _run(
        self,
        name: str,
        configured: Sequence[TenantLoad],
        loads: Sequence[TenantLoad],
        duration_s: float,
        *,
        workers: int = 1,
        journal: bool = False,
    ) -> LoadRun:
        """A fresh router with `configured`'s `[[tenants]]`, `loads` driven through it;
        with `journal`, each tenant's time in the router's queue is printed from the
        router's journal (kept as NAME.jsonl in the run's directory)."""
        path = self.running.bench.workdir / f"{name}.jsonl"
        settings: dict[str, dict[str, object]] = {}
        if journal:
            settings["journal"] = {"path": str(path)}
        if self.plan.reserved_seats:
            settings["tenants_policy"] = {"reserved_seats": self.plan.reserved_seats}
        url = await self.running.start_router(name, configured, workers=workers, settings=settings)
        try:
            run = await self.running.run(url, name, loads, duration_s, self.plan.seed)
            if workers > 1:
                self.figures.setdefault("requests_by_worker", {})[name] = await requests_by_worker(
                    url
                )
        finally:
            await self.running.stop_router(name)
        if run.router_cpu_s is not None and run.wall_s > 0:
            # Whether the router (or the machine) was short of CPU, which would add to TTFT.
            say(
                f"  {name}: router CPU {run.router_cpu_s:.1f} s over {run.wall_s:.1f} s "
                f"({100 * run.router_cpu_s / run.wall_s:.0f} % of a core), load processes "
                f"{run.load_cpu_s:.1f} s, engines {run.producer_cpu_s + run.consumer_cpu_s:.1f} s; "
                f"the machine's load average {os.getloadavg()[0]:.1f}"
            )
        if journal and path.exists():
            entries = journal_entries(path.read_bytes().splitlines())
            self._journal(name, entries, saturated=len(loads) > 1)
        return run

    def _journal(self, name: str, entries: Sequence[dict[str, Any]], *, saturated: bool) -> None:
        """What the router's journal says of each tenant's wait, and of the fleet's seat
        releases: a request served at the very next release waits `next_release_wait`.
        A `saturated` run should serve the calibrated capacity: a warning when it did not
        (other work on the machine starved the engines)."""
        figures: dict[str, Any] = {}
        for tenant, waits in sorted(queue_waits(entries, self.plan.settle_s).items()):
            say(
                f"  {name}: {tenant} ({waits.requests} answered, the router's journal): in the "
                f"router's queue p50 {waits.queue_p50_s * 1000:.1f} ms, p99 "
                f"{waits.queue_p99_s * 1000:.1f} ms; first token after it p50 "
                f"{waits.rest_p50_s * 1000:.1f} ms, p99 {waits.rest_p99_s * 1000:.1f} ms"
            )
            figures[tenant] = asdict(waits)
        ends = sorted(e["ts"] for e in entries if e.get("status") == 200 and is_number(e.get("ts")))
        # The middle of the run: past the settling, before the queue drains at its end.
        start, stop = (ends[0] if ends else 0.0) + self.plan.settle_s, self.plan.run_s
        middle = [t for t in ends if start <= t <= (ends[0] if ends else 0.0) + stop]
        p50, p99 = next_release_wait(middle, 0.5), next_release_wait(middle, 0.99)
        if p50 is not None and p99 is not None and len(middle) > 100:
            say(
                f"  {name}: from a random moment to the next seat released (requests ending): "
                f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
            )
            figures["next_release_wait"] = {"p50_s": p50, "p99_s": p99}
        if saturated and self.capacity and len(middle) > 1:
            served = (len(middle) - 1) / (middle[-1] - middle[0])
            figures["served_rps"] = served
            if served < 0.8 * self.capacity:
                say(
                    f"  WARNING {name}: the fleet served {served:.1f} requests/s against the "
                    f"{self.capacity:.1f} calibrated: the machine was short of CPU, so this "
                    "run's latencies say little about the router"
                )
        self.figures.setdefault("journal", {})[name] = figures

    def _tenant(self, name: str, **fields: Any) -> TenantLoad:
        shape = self.plan.shape
        fields.setdefault("prompt_tokens", shape.prompt_tokens)
        fields.setdefault("max_tokens", shape.max_tokens)
        return TenantLoad(name=name, **fields)

    async def calibrate(self) -> float:
        """The fleet's capacity in requests/s: a closed loop of twice its seats."""
        plan = self.plan
        seats = max(1, plan.shape.decode_seats)
        tenant = self._tenant("calibrate", concurrency=2 * seats)
        run = await self._run("calibrate", [tenant], [tenant], plan.calibrate_s)
        window = (plan.calibrate_s / 3, plan.calibrate_s)
        capacity = capacity_rps(run.records, window)
        stats = run.stats("calibrate", self.slo, window, by_end=True)
        interval = 1000 / capacity if capacity else math.nan
        say(
            f"calibration: capacity {capacity:.1f} requests/s with {plan.shape.decode_seats} "
            f"decode seats: a seat frees every {interval:.1f} ms on average, a request holds "
            f"one {seats / capacity if capacity else math.nan:.2f} s; saturated TTFT p50 "
            f"{(stats.ttft_p50_s or 0) * 1000:.0f} ms (time in the router's queue included)"
        )
        self.figures["calibration"] = {"capacity_rps": capacity, "stats": stats_json(stats)}
        self.capacity = capacity
        return capacity

    async def _light_then_flooded(
        self, name: str, light: TenantLoad, flood: TenantLoad
    ) -> tuple[TenantStats, TenantStats, TenantStats]:
        """`light` alone, then beside `flood` (both runs journaled): the light tenant's
        figures alone and flooded, and the flood's."""
        plan = self.plan
        window = (plan.settle_s, plan.run_s)
        both = [flood, light]
        alone_run = await self._run(f"{name}-alone", both, [light], plan.run_s, journal=True)
        flood_run = await self._run(f"{name}-flood", both, both, plan.run_s, journal=True)
        return (
            alone_run.stats(light.name, self.slo, window),
            flood_run.stats(light.name, self.slo, window),
            flood_run.stats(flood.name, self.slo, window),
        )

    async def isolation(self, capacity: float) -> None:
        """B at light load alone, then beside A flooding at `flood_factor` x capacity."""
        plan = self.plan
        settings: dict[str, float] = {"weight": 1.0}
        if plan.objective_s is not None:
            settings["ttft_objective_s"] = plan.objective_s
        pairs = tuple(settings.items())
        light = self._tenant("b", settings=pairs, rate=plan.light_share * capacity)
        flood = self._tenant("a", settings=pairs, rate=plan.flood_factor * capacity)
        alone, flooded, a = await self._light_then_flooded("isolation", light, flood)
        say(f"isolation, B alone:   {stats_line(alone)}")
        say(f"isolation, B flooded: {stats_line(flooded)}")
        say(f"isolation, A:         {stats_line(a)}")
        goodput = ratio(flooded.goodput_rps, alone.goodput_rps)
        p99 = ratio(flooded.ttft_p99_s, alone.ttft_p99_s)
        self.verdicts += [
            verdict(
                "isolation",
                "B goodput, flooded / alone",
                goodput,
                ">= 0.95",
                at_least(goodput, 0.95),
            ),
            verdict("isolation", "B TTFT p99, flooded / alone", p99, "<= 2.0", at_most(p99, 2.0)),
            verdict(
                "isolation",
                "B requests refused while flooded",
                flooded.refused_total,
                "0",
                flooded.refused_total == 0,
            ),
        ]
        self.figures["isolation"] = {
            "rates": {"a": flood.rate, "b": light.rate},
            "settings": settings,
            "b_alone": stats_json(alone),
            "b_flooded": stats_json(flooded),
            "a": stats_json(a),
        }

    async def weights(self) -> None:
        """Two closed loops, each able to fill the fleet alone, at weights 3:1."""
        plan = self.plan
        concurrency = 2 * max(1, plan.shape.decode_seats)
        heavy = self._tenant("w3", settings=(("weight", 3.0),), concurrency=concurrency)
        light = self._tenant("w1", settings=(("weight", 1.0),), concurrency=concurrency)
        duration = plan.weights_warm_s + plan.weights_s
        run = await self._run("weights", [heavy, light], [heavy, light], duration)
        window = (plan.weights_warm_s, duration)
        three = run.stats("w3", self.slo, window, by_end=True)
        one = run.stats("w1", self.slo, window, by_end=True)
        say(f"weights, weight 3: {stats_line(three)}")
        say(f"weights, weight 1: {stats_line(one)}")
        served = ratio(three.tokens_served, one.tokens_served)
        say(
            f"weights: tokens served {three.tokens_served:,} : {one.tokens_served:,} over "
            f"{plan.weights_s:g} s = {served or math.nan:.3f} : 1"
        )
        self.verdicts.append(
            verdict(
                "weights",
                f"tokens served 3:1 over {plan.weights_s:g} s (ratio)",
                served,
                "2.7 .. 3.3",
                served is not None and 2.7 <= served <= 3.3,
            )
        )
        self.figures["weights"] = {"w3": stats_json(three), "w1": stats_json(one), "ratio": served}

    async def priority(self, capacity: float) -> None:
        """Band 0 at light load alone, then beside band 1 flooding."""
        plan = self.plan
        important = self._tenant(
            "band0", settings=(("priority", 0),), rate=plan.light_share * capacity
        )
        flood = self._tenant(
            "band1", settings=(("priority", 1),), rate=plan.flood_factor * capacity
        )
        alone, flooded, low = await self._light_then_flooded("priority", important, flood)
        say(f"priority, band 0 alone:   {stats_line(alone)}")
        say(f"priority, band 0 flooded: {stats_line(flooded)}")
        say(f"priority, band 1:         {stats_line(low)}")
        p99 = ratio(flooded.ttft_p99_s, alone.ttft_p99_s)
        self.verdicts += [
            verdict(
                "priority", "band 0 TTFT p99, flooded / alone", p99, "<= 1.5", at_most(p99, 1.5)
            ),
            verdict(
                "priority",
                "band 0 requests refused while flooded",
                flooded.refused_total,
                "0",
                flooded.refused_total == 0,
            ),
            verdict(
                "priority",
                "band 1 requests refused (shed first)",
                low.refused_total,
                "> 0",
                low.refused_total > 0,
            ),
        ]
        self.figures["priority"] = {
            "rates": {"band0": important.rate, "band1": flood.rate},
            "band0_alone": stats_json(alone),
            "band0_flooded": stats_json(flooded),
            "band1": stats_json(low),
        }

    async def limits(self, workers: int) -> None:
        """Per-minute limits against their buckets, and Retry-After honoured."""
        plan = self.plan
        cost = plan.shape.prompt_tokens + plan.shape.max_tokens
        retry_cost = plan.shape.prompt_tokens + plan.retry_max_tokens
        tenants = [
            self._tenant(
                "rpm",
                settings=(("requests_per_minute", plan.rpm),),
                rate=plan.over * plan.rpm / 60,
                arrivals="fixed",
            ),
            self._tenant(
                "tpm",
                settings=(("tokens_per_minute", plan.tpm),),
                rate=plan.over * plan.tpm / 60 / cost,
                arrivals="fixed",
            ),
            self._tenant(
                "rpm-retry",
                settings=(("requests_per_minute", plan.retry_rpm),),
                concurrency=1,
                max_tokens=plan.retry_max_tokens,
                retry_after=True,
            ),
            self._tenant(
                "tpm-retry",
                settings=(("tokens_per_minute", plan.retry_tpm),),
                concurrency=1,
                max_tokens=plan.retry_max_tokens,
                retry_after=True,
            ),
        ]
        name = f"limits-w{workers}"
        run = await self._run(name, tenants, tenants, plan.limits_s, workers=workers)
        label = "limits" if workers == 1 else f"limits w{workers}"
        figures: dict[str, Any] = {}
        rpm_in = admitted(run.records, "rpm")
        rpm_allowed = bucket_allows(plan.rpm, send_span(run.records, "rpm"))
        tpm_in = admitted(run.records, "tpm")
        tpm_tokens = sum(r.prompt_tokens + r.completion_tokens if r.ok else cost for r in tpm_in)
        tpm_allowed = bucket_allows(plan.tpm, send_span(run.records, "tpm"))
        # What the bucket lets in of what was sent: a run too short to empty it admits all.
        rpm_sent = sum(r.tenant == "rpm" for r in run.records)
        tpm_sent = cost * sum(r.tenant == "tpm" for r in run.records)
        rpm_share = ratio(len(rpm_in), min(rpm_allowed, rpm_sent))
        tpm_share = ratio(tpm_tokens, min(tpm_allowed, tpm_sent))
        say(
            f"{label}: requests_per_minute {plan.rpm:g}: admitted {len(rpm_in)} of "
            f"{sum(r.tenant == 'rpm' for r in run.records)} sent, the bucket allows "
            f"{rpm_allowed:.1f} over {send_span(run.records, 'rpm'):.2f} s"
        )
        say(
            f"{label}: tokens_per_minute {plan.tpm:g}: admitted {tpm_tokens:,} tokens "
            f"({len(tpm_in)} requests of {cost}), the bucket allows {tpm_allowed:,.0f} over "
            f"{send_span(run.records, 'tpm'):.2f} s"
        )
        self.verdicts += [
            verdict(
                label, "rpm: admitted / bucket allows", rpm_share, "0.98 .. 1.02", near(rpm_share)
            ),
            verdict(
                label,
                "tpm: admitted tokens / bucket allows",
                tpm_share,
                "0.98 .. 1.02",
                near(tpm_share),
            ),
        ]
        for tenant in ("rpm-retry", "tpm-retry"):
            stats = run.stats(tenant, self.slo)
            say(
                f"{label}: {tenant} (cost {retry_cost} tokens): {stats_line(stats)}; came back "
                f"{stats.returns} times after Retry-After, admitted {stats.admitted_on_return}"
            )
            share = ratio(stats.admitted_on_return, stats.returns)
            self.verdicts.append(
                verdict(
                    label,
                    f"{tenant}: returns after Retry-After admitted",
                    share,
                    "1.0 (all)",
                    share == 1.0 if stats.returns else None,
                )
            )
            figures[tenant] = stats_json(stats)
        figures |= {
            "rpm": {"admitted": len(rpm_in), "allowed": rpm_allowed},
            "tpm": {"admitted_tokens": tpm_tokens, "allowed_tokens": tpm_allowed},
            "stats": {t.name: stats_json(run.stats(t.name, self.slo)) for t in tenants[:2]},
        }
        self.figures[label] = figures


def say(text: str) -> None:
    print(text, flush=True)


# --- Command line ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    d, s = Plan(), FleetShape()
    add("--only", help=f"comma-separated experiments (default all: {','.join(EXPERIMENTS)})")
    add("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="engine timing")
    add("--speed", type=float, default=s.speed, help="engines run this many times faster")
    add("--decode-seats", type=int, default=s.decode_seats, help="the consumer's seats")
    add("--prompt-tokens", type=int, default=s.prompt_tokens, help="prompt length (token ids)")
    add("--max-tokens", type=int, default=s.max_tokens, help="output tokens")
    add("--run-s", type=float, default=d.run_s, help="isolation and priority runs, each")
    add("--light-share", type=float, default=d.light_share, help="light load / capacity")
    add("--flood-factor", type=float, default=d.flood_factor, help="flood / capacity")
    add("--objective-s", type=float, help="isolation: both tenants' ttft_objective_s")
    add("--reserved-seats", type=int, default=0, help="[tenants_policy] reserved_seats")
    add("--weights-s", type=float, default=d.weights_s, help="weights: the measured span")
    add("--limits-s", type=float, default=d.limits_s, help="limits: each run")
    add("--cpu-requests", type=int, default=d.cpu_requests, help="cpu: requests per batch")
    add("--cpu-trials", type=int, default=d.cpu_trials, help="cpu: interleaved trials")
    add("--baseline", type=Path, help="cpu: also the router of this source tree's src/")
    add("--seed", type=int, default=d.seed, help="fixes arrivals and prompts")
    add("--json", type=Path, help="write every figure to this JSON file")
    add("--workdir", type=Path, help="keep configs and logs here (default: a temp dir)")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    shape = FleetShape(
        profile=args.profile,
        speed=args.speed,
        decode_seats=args.decode_seats,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
    )
    return Plan(
        shape=shape,
        seed=args.seed,
        light_share=args.light_share,
        flood_factor=args.flood_factor,
        run_s=args.run_s,
        objective_s=args.objective_s,
        reserved_seats=args.reserved_seats,
        weights_s=args.weights_s,
        limits_s=args.limits_s,
        cpu_requests=args.cpu_requests,
        cpu_trials=args.cpu_trials,
        baseline=args.baseline.resolve() if args.baseline else None,
    )


def chosen(only: str | None) -> tuple[str, ...]:
    """The experiments `--only` names, in the order run; raises ValueError for others."""
    if only is None:
        return EXPERIMENTS
    names = tuple(name.strip() for name in only.split(",") if name.strip())
    unknown = [name for name in names if name not in EXPERIMENTS]
    if unknown or not names:
        raise ValueError(f"--only: experiments are {', '.join(EXPERIMENTS)}; got {only!r}")
    return tuple(name for name in EXPERIMENTS if name in names)


async def run_all(
    plan: Plan, names: Sequence[str], workdir: Path
) -> tuple[list[Verdict], dict[str, Any]]:
    verdicts: list[Verdict] = []
    figures: dict[str, Any] = {"plan": asdict(plan), "slo": asdict(plan.shape.slo())}
    if any(name != "cpu" for name in names):
        async with tenant_fleet(plan.shape, workdir) as running:
            experiments = Experiments(running, plan)
            shape, slo = plan.shape, experiments.slo
            say(
                f"fleet: 1P+1D {shape.profile} at speed {shape.speed:g}, {shape.decode_seats} "
                f"decode seats, requests of {shape.prompt_tokens} prompt + {shape.max_tokens} "
                f"output tokens; SLO TTFT <= {slo.ttft_s * 1000:.0f} ms, TPOT <= "
                f"{slo.tpot_s * 1000:.1f} ms"
            )
            capacity = None
            if "isolation" in names or "priority" in names:
                capacity = await experiments.calibrate()
            if "isolation" in names:
                assert capacity is not None
                await experiments.isolation(capacity)
            if "weights" in names:
                await experiments.weights()
            if "priority" in names:
                assert capacity is not None
                await experiments.priority(capacity)
            if "limits" in names:
                await experiments.limits(1)
                await experiments.limits(2)
            verdicts += experiments.verdicts
            figures |= experiments.figures
    if "cpu" in names:
        cpu_verdicts, cpu_figures = await no_tenants_cpu(
            workdir, plan.cpu_requests, plan.cpu_trials, plan.baseline
        )
        verdicts += cpu_verdicts
        figures["cpu"] = cpu_figures
    return verdicts, figures


async def _main(args: argparse.Namespace) -> int:
    try:
        names = chosen(args.only)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    plan = plan_from_args(args)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tenants-")))
        workdir.mkdir(parents=True, exist_ok=True)
        verdicts, figures = await run_all(plan, names, workdir)
    print()
    print(format_verdicts(verdicts))
    if args.json:
        figures["verdicts"] = [asdict(v) for v in verdicts]
        args.json.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2, default=str))
        print(f"figures written to {args.json}")
    return 0 if all(v.met is not False for v in verdicts) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiments; the exit status is 1 when a figure misses its target."""
    return uvloop.run(_main(parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

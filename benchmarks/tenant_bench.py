"""`narwhal bench --tenant ...`: multi-tenant load through Narwhal on a saturable simulated fleet.

    narwhal bench --tenant batch:rate=300 --tenant chat:rate=4 --duration 30
    narwhal bench --tenant a:weight=3,concurrency=48 --tenant b:weight=1,concurrency=48

Each `--tenant` (see `narwhal.tools.goodput.tenants`) is one `[[tenants]]` entry in the
router's configuration and one load shape: open loop at `rate` requests/s (`arrivals`
poisson or fixed), or closed loop with `concurrency` clients, each request sent with the
tenant's key and, with `retry_after=true`, sent again after each refusal's `Retry-After`.
Each tenant's load runs in a load process of its own (`bench_load.py`), so a flood's
client never delays another tenant's reading of its tokens.

Unlike the other bench modes, the engines here take time: every timing comes from a
`narwhal sim --profile` (default `llama-3.1-8b-h100`), and the consumer's seats are limited
(`--decode-seats`, the engine's `max_num_seqs` too), so a load past the fleet's capacity
waits in the router's queue, where the tenants' scheduler orders it, not in the engine.

Prints one row per tenant (requests, answered, refused by status, goodput within the
profile's SLOs, TTFT p50/p99, tokens served) and the router's CPU over the run.
`benchmarks/tenant_experiments.py` runs the issue's experiments on the same pieces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvloop
from bench_model import SHAPES
from bench_procs import MODEL, Proc, cpu_seconds, raise_open_files_limit
from bench_targets import Bench, Settings, SimSettings, fleet, start_loads, start_narwhal

from narwhal.tools.goodput.score import Slo, default_slo
from narwhal.tools.goodput.tenants import (
    Record,
    TenantLoad,
    TenantStats,
    check_tenants,
    format_stats,
    parse_tenant,
    stats_json,
    tenant_stats,
    with_defaults,
)
from narwhal.tools.sim.options import profile_options
from narwhal.tools.sim.profiles import PROFILES

DEFAULT_PROFILE = "llama-3.1-8b-h100"
START_DELAY_S = 1.0
"""The load processes are told to start this far ahead, so that they start together."""


@dataclass(frozen=True, slots=True)
class FleetShape:
    """The 1P+1D fleet and the router's queue: what saturates, and where requests wait."""

    profile: str = DEFAULT_PROFILE
    speed: float = 1.0
    decode_seats: int = 32
    queue_capacity: int = 1024
    queue_timeout_s: float = 30.0
    prompt_tokens: int = 128
    max_tokens: int = 64

    def sim_settings(self) -> SimSettings:
        """Engines with as many sequences as the router has decode seats, and KV for them."""
        seqs = max(1, self.decode_seats)
        blocks_per_seq = math.ceil((self.prompt_tokens + 4 * self.max_tokens) / 16) + 1
        return SimSettings(
            inter_token_s=0.0,
            prefill_s_per_token=0.0,
            max_num_seqs=seqs,
            num_kv_blocks=max(8192, 4 * seqs * blocks_per_seq),
            max_model_len=8192,
            profile=self.profile,
            speed=self.speed,
        )

    def router_settings(self) -> dict[str, dict[str, object]]:
        return {
            "serving": {
                "queue_capacity": self.queue_capacity,
                "queue_timeout_s": self.queue_timeout_s,
            }
        }

    def slo(self) -> Slo:
        """The profile's default SLOs (`narwhal goodput`'s), in wall seconds at `speed`."""
        options = profile_options(self.profile, speed=self.speed)
        return default_slo(options.step_costs, options.request_overhead_s / self.speed)


@dataclass(slots=True)
class LoadRun:
    """What one run of tenants' load measured."""

    records: list[Record]
    duration_s: float
    wall_s: float
    router_cpu_s: float | None
    load_cpu_s: float
    producer_cpu_s: float
    consumer_cpu_s: float

    def stats(
        self,
        tenant: str,
        slo: Slo | None,
        window: tuple[float, float] | None = None,
        *,
        by_end: bool = False,
    ) -> TenantStats:
        """`tenant`'s figures over `window` (default: the whole run) of send times, or
        with `by_end` of end times."""
        span = window or (0.0, self.duration_s)
        return tenant_stats(tenant, self.records, window=span, slo=slo, by_end=by_end)


@dataclass(slots=True)
class TenantFleet:
    """A running fleet, the routers started over it, and load processes to reuse."""

    bench: Bench
    shape: FleetShape
    routers: dict[str, Proc] = field(default_factory=dict)

    async def start_router(
        self,
        name: str,
        tenants: Sequence[TenantLoad],
        *,
        workers: int = 1,
        settings: Settings | None = None,
    ) -> str:
        """`narwhal serve` with the tenants' `[[tenants]]` over this fleet; its URL."""
        merged: dict[str, dict[str, object]] = self.shape.router_settings()
        for table, keys in (settings or {}).items():
            merged.setdefault(table, {}).update(keys)
        proc, url = await start_narwhal(
            self.bench.producer_url,
            self.bench.consumer_url,
            self.bench.workdir,
            name=name,
            queue=self.shape.queue_capacity,
            settings=merged,
            tenants=[tenant.tenant_table() for tenant in tenants],
            decode_seats=self.shape.decode_seats,
            workers=workers,
        )
        self.routers[name] = proc
        self.bench.pids[name] = proc.pid
        return url

    async def stop_router(self, name: str) -> None:
        proc = self.routers.pop(name)
        await proc.stop()

    async def run(
        self,
        url: str,
        router: str | None,
        tenants: Sequence[TenantLoad],
        duration_s: float,
        seed: int,
    ) -> LoadRun:
        """Every tenant's load, each in its own load process, for `duration_s`; CPU of the
        router named `router` (its processes) and of the engines over the run."""
        missing = len(tenants) - len(self.bench.loads)
        if missing > 0:
            await start_loads(self.bench, missing)
        pid = self.routers[router].pid if router is not None else None
        before = self._cpu(pid)
        start_at = time.time() + START_DELAY_S
        jobs = [
            load.ask(
                {
                    "job": "tenants",
                    "url": url,
                    "model": MODEL,
                    "duration_s": duration_s,
                    "seed": seed,
                    "start_at": start_at,
                    "tenants": [tenant.to_json()],
                }
            )
            for load, tenant in zip(self.bench.loads, tenants, strict=False)
        ]
        started = time.monotonic()
        answers = await asyncio.gather(*jobs)
        wall = time.monotonic() - started - START_DELAY_S
        after = self._cpu(pid)
        records = [Record.from_row(row) for answer in answers for row in answer["records"]]
        return LoadRun(
            records=records,
            duration_s=duration_s,
            wall_s=wall,
            router_cpu_s=after["router"] - before["router"] if pid is not None else None,
            load_cpu_s=sum(answer["cpu_s"] for answer in answers),
            producer_cpu_s=after["producer"] - before["producer"],
            consumer_cpu_s=after["consumer"] - before["consumer"],
        )

    def _cpu(self, pid: int | None) -> dict[str, float]:
        cpu = {
            "producer": cpu_seconds(self.bench.producer.pid),
            "consumer": cpu_seconds(self.bench.consumer.pid),
        }
        if pid is not None:
            cpu["router"] = cpu_seconds(pid)
        return cpu


@contextlib.asynccontextmanager
async def tenant_fleet(shape: FleetShape, workdir: Path) -> AsyncIterator[TenantFleet]:
    """A 1P+1D simulated fleet of `shape`'s profile; everything started stops on exit."""
    raise_open_files_limit()
    async with fleet(shape.sim_settings(), 0, 0, workdir) as bench:
        running = TenantFleet(bench, shape)
        try:
            yield running
        finally:
            for name in list(running.routers):
                await running.stop_router(name)


def shaped(tenants: Sequence[TenantLoad], shape: FleetShape) -> list[TenantLoad]:
    """Each tenant with the fleet's prompt and output lengths where its spec gave none; a
    bench shape (`short`, `long`, `stream`) sets its output length."""
    out = []
    for tenant in tenants:
        max_tokens = shape.max_tokens
        if tenant.shape is not None:
            if tenant.shape not in (*SHAPES, "stream") or tenant.shape == "mixed-nonstream":
                raise ValueError(
                    f"--tenant {tenant.name}: shape must be short, long or stream "
                    f"(streaming completions), got {tenant.shape!r}"
                )
            max_tokens = SHAPES.get(tenant.shape, 256)
        out.append(with_defaults(tenant, prompt_tokens=shape.prompt_tokens, max_tokens=max_tokens))
    return out


def report(run: LoadRun, tenants: Sequence[TenantLoad], slo: Slo) -> str:
    """The per-tenant table and what the run cost."""
    stats = [run.stats(tenant.name, slo) for tenant in tenants]
    served = sum(s.tokens_served for s in stats)
    answered = sum(s.ok for s in stats)
    lines = [
        format_stats(stats),
        "",
        f"goodput: answered within TTFT <= {slo.ttft_s * 1000:.0f} ms and TPOT <= "
        f"{slo.tpot_s * 1000:.1f} ms, per second of the {run.duration_s:g} s run; tokens: "
        "prompt + completion of answered requests; returns ok: returns after a Retry-After "
        "admitted / sent",
        f"served {answered / run.duration_s:.1f} requests/s, {served / run.duration_s:,.0f} "
        "tokens/s",
    ]
    if run.router_cpu_s is not None:
        per = run.router_cpu_s / max(1, len(run.records)) * 1000
        lines.append(
            f"router CPU {run.router_cpu_s:.2f} s ({per:.3f} s per 1,000 requests sent); "
            f"load {run.load_cpu_s:.2f} s, producer {run.producer_cpu_s:.2f} s, consumer "
            f"{run.consumer_cpu_s:.2f} s"
        )
    return "\n".join(lines)


def document(run: LoadRun, tenants: Sequence[TenantLoad], shape: FleetShape) -> dict[str, Any]:
    slo = shape.slo()
    return {
        "fleet": {
            "profile": shape.profile,
            "speed": shape.speed,
            "decode_seats": shape.decode_seats,
            "queue_capacity": shape.queue_capacity,
        },
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "duration_s": run.duration_s,
        "tenants": [
            {"load": tenant.to_json(), "stats": stats_json(run.stats(tenant.name, slo))}
            for tenant in tenants
        ],
        "router_cpu_s": run.router_cpu_s,
        "load_cpu_s": run.load_cpu_s,
    }


# --- Command line ---------------------------------------------------------------------------


def _tenant(text: str) -> TenantLoad:
    try:
        return parse_tenant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="narwhal bench --tenant", description=__doc__.splitlines()[0])
    add = p.add_argument
    add(
        "--tenant",
        type=_tenant,
        action="append",
        required=True,
        metavar="NAME:KEY=VALUE,...",
        help="one tenant: its [[tenants]] keys and its load (rate=R or concurrency=C); "
        "repeat per tenant",
    )
    add("--duration", type=float, default=30.0, help="seconds of load")
    add("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="engine timing")
    add("--speed", type=float, default=1.0, help="engines run this many times faster")
    d = FleetShape()
    add("--decode-seats", type=int, default=d.decode_seats, help="consumer's seats")
    add("--queue-capacity", type=int, default=d.queue_capacity, help="router queue")
    add("--prompt-tokens", type=int, default=d.prompt_tokens, help="default prompt tokens")
    add("--max-tokens", type=int, default=d.max_tokens, help="default output tokens")
    add("--workers", type=int, default=1, help="router processes (narwhal serve --workers)")
    add("--default-tenant", help="[tenants_policy] default: the tenant of keyless requests")
    add("--seed", type=int, default=0, help="fixes arrivals and prompts")
    add("--json", type=Path, help="write every figure to this JSON file")
    add("--workdir", type=Path, help="keep configs and logs here (default: a temp dir)")
    return p


async def _main(args: argparse.Namespace) -> int:
    shape = FleetShape(
        profile=args.profile,
        speed=args.speed,
        decode_seats=args.decode_seats,
        queue_capacity=args.queue_capacity,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
    )
    try:
        tenants = shaped(args.tenant, shape)
        check_tenants(tenants)
    except ValueError as exc:
        print(f"narwhal bench: {exc}", file=sys.stderr)
        return 2
    settings: dict[str, Mapping[str, object]] = {}
    if args.default_tenant:
        settings["tenants_policy"] = {"default": args.default_tenant}
    with contextlib.ExitStack() as stack:
        workdir = args.workdir
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        async with tenant_fleet(shape, workdir) as running:
            url = await running.start_router(
                "narwhal", tenants, workers=args.workers, settings=settings
            )
            print(
                f"narwhal at {url} over a 1P+1D {shape.profile} fleet (speed {shape.speed:g}, "
                f"{shape.decode_seats} decode seats); {len(tenants)} tenants for "
                f"{args.duration:g} s",
                flush=True,
            )
            run = await running.run(url, "narwhal", tenants, args.duration, args.seed)
    print()
    print(report(run, tenants, shape.slo()))
    if args.json:
        args.json.write_bytes(
            orjson.dumps(document(run, tenants, shape), option=orjson.OPT_INDENT_2)
        )
        print(f"figures written to {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run from the command line (`narwhal bench --tenant ...`)."""
    args = parser().parse_args(argv)
    if args.workers < 1 or args.duration <= 0 or args.decode_seats < 0:
        print("narwhal bench: --workers >= 1, --duration > 0, --decode-seats >= 0", file=sys.stderr)
        return 2
    return uvloop.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())

"""`narwhal bench --workers N`: one Narwhal process against `narwhal serve --workers N`, on
the same simulated fleet, under the same load, in interleaved trials.

Prints the usual tables (the direct path, `narwhal`, `narwhal-wN`), then what the workers
add: router CPU per request of N workers over one (supervisor and workers together, from
/proc), the requests each worker served (`narwhal_worker_requests_total`), the CPU each
worker spent, and throughput of N workers over one. With engines that answer at once
(`--inter-token-s 0`, the default) the router is the bottleneck, so tokens/s through it is
its throughput ceiling on this machine: every party shares its cores, so N workers can
raise the ceiling only as far as the engines and the load generator leave CPU free.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import orjson
import uvloop
from bench_load import Target
from bench_model import BenchOptions, BenchReport
from bench_procs import Proc, _descendants, cpu_seconds, free_port, raise_open_files_limit
from bench_report import format_report, report_json
from bench_targets import (
    add_router,
    fleet,
    narwhal_config,
    start_loads,
    start_narwhal,
    wait_healthy,
)
from core_cap import CoreCap
from router_bench import _trials, options_from_args, parser, sim_settings


@dataclass(frozen=True, slots=True)
class WorkersReport:
    bench: BenchReport
    workers: int
    # Finished requests by worker, from the router's own /metrics, and each worker's CPU.
    requests_by_worker: dict[str, float]
    cpu_s_by_worker: dict[int, float]
    # With `--core-cap`: each router process's share of one core, and the seconds each
    # target's processes spent held back by it (the cap was what bounded them).
    core_cap: float | None = None
    throttled_s: dict[str, float] | None = None


async def start_workers(
    producer: str, consumer: str, workdir: Path, workers: int
) -> tuple[Proc, str]:
    """`narwhal serve --workers N` with the one-process target's config."""
    port = free_port()
    name = f"narwhal-w{workers}"
    config = workdir / f"{name}.toml"
    config.write_text(narwhal_config(producer, consumer, port))
    argv = [
        *(sys.executable, "-m", "narwhal", "serve", "--config", str(config)),
        *("--skip-preflight", "--workers", str(workers)),
    ]
    proc = await Proc.start(name, argv, workdir)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(proc, url)
    return proc, url


async def requests_by_worker(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    split: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("narwhal_worker_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            split[labels.split('"')[1]] = float(value)
    return split


def cpu_by_worker(supervisor: int) -> dict[int, float]:
    """Each worker process's CPU seconds since it started (warm-up included)."""
    return {pid: cpu_seconds(pid) for pid in _descendants(supervisor)[1:]}


async def run(
    options: BenchOptions, workers: int, workdir: Path, core_cap: float | None = None
) -> WorkersReport:
    raise_open_files_limit()
    settings = sim_settings(options, options.concurrency, options.max_tokens)
    say = print if not options.quiet else (lambda *_: None)
    async with fleet(settings, options.producer_port, options.consumer_port, workdir) as bench:
        producer, consumer = bench.producer_url, bench.consumer_url
        if options.direct:
            bench.targets.append(Target("direct", producer=producer, consumer=consumer))
        await add_router(bench, "narwhal", start_narwhal(producer, consumer, workdir))
        name = f"narwhal-w{workers}"
        url = await add_router(bench, name, start_workers(producer, consumer, workdir, workers))
        say(f"engines {producer} {consumer}; {name} at {url} (pid {bench.pids[name]})")
        caps = {"narwhal": CoreCap(core_cap), name: CoreCap(core_cap)} if core_cap else {}
        try:
            for target, cap in caps.items():
                # Every process of the target, each in a group of its own: N workers get
                # N times one process's CPU (the supervisor, mostly idle, its own too).
                for pid in _descendants(bench.pids[target]):
                    cap.cap(pid)
            if caps:
                say(f"each router process capped at {core_cap:g} of a core")
            await start_loads(bench, options.load_processes)
            report = await _trials(bench, options, say)
            throttled = {target: cap.throttled_s() for target, cap in caps.items()}
        finally:
            for cap in caps.values():
                cap.close()
        return WorkersReport(
            report,
            workers,
            await requests_by_worker(url),
            cpu_by_worker(bench.pids[name]),
            core_cap,
            throttled or None,
        )


def format_workers(report: WorkersReport) -> str:
    one, many = report.bench.summary("narwhal"), report.bench.summary(f"narwhal-w{report.workers}")
    total = sum(report.requests_by_worker.values()) or 1.0
    split = ", ".join(
        f"worker {worker} {count:.0f} ({count / total:.0%})"
        for worker, count in sorted(report.requests_by_worker.items())
    )
    cpu = ", ".join(f"{seconds:.1f} s" for seconds in report.cpu_s_by_worker.values())
    cpu_many, cpu_one = many.router_cpu_s_per_1k_requests, one.router_cpu_s_per_1k_requests
    lines = [
        f"{report.workers} workers over one process (same run, interleaved trials):",
        f"  router CPU per 1k requests: {_ratio(cpu_many, cpu_one)}"
        f" ({_number(cpu_many)} s vs {_number(cpu_one)} s)",
        f"  tokens/s: {_ratio(many.tokens_per_s, one.tokens_per_s)}"
        f" ({many.tokens_per_s:,.0f} vs {one.tokens_per_s:,.0f})",
        f"  requests by worker (all batches, warm-up included): {split}",
        f"  CPU by worker process (since start): {cpu}",
    ]
    if report.core_cap is not None and report.throttled_s is not None:
        held = ", ".join(f"{name} {s:.1f} s" for name, s in report.throttled_s.items())
        lines.append(
            f"  each router process capped at {report.core_cap:g} of a core;"
            f" time held back by the cap: {held}"
        )
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def main(argv: Sequence[str]) -> int:
    p = parser()
    p.add_argument("--workers", type=int, required=True, help="workers of the second target")
    p.add_argument(
        "--core-cap",
        type=float,
        help="cap each router process at this fraction of one core (a cgroup quota), so that "
        "the router, not the engines or the load, is the bottleneck",
    )
    args = p.parse_args(argv)
    options = replace(options_from_args(args), vllm_router=None, fastapi_proxy=None)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        report = uvloop.run(run(options, args.workers, workdir, args.core_cap))
    print()
    print(format_report(report.bench))
    print()
    print(format_workers(report))
    if args.json:
        document = orjson.loads(report_json(report.bench))
        document["workers"] = {
            "workers": report.workers,
            "requests_by_worker": report.requests_by_worker,
            "cpu_s_by_worker": list(report.cpu_s_by_worker.values()),
            "core_cap": report.core_cap,
            "throttled_s": report.throttled_s,
        }
        args.json.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return 1 if any(s.errors for s in report.bench.summaries) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Narwhal against the direct path and other prefill/decode routers, on a simulated fleet.

Every party runs in its own process: one simulated producer and one simulated consumer
(`narwhal sim`), each router, and the load generator (`bench_load.py`). The direct path is
the load generator doing the prefill and the decode against the engines itself, so what
separates it from a router target is the router alone. Trials are interleaved (each trial
runs one batch per target) so that drift on the machine spreads over every target.

CPU and memory are read from the OS (/proc), never estimated. Run it as

    .venv/bin/python benchmarks/router_bench.py [--shape short|long|mixed-nonstream]
        [--concurrency 64] [--max-tokens 256] [--trials 3] [--json out.json] [--plot out.png]

or `narwhal bench ...` with the same flags. `--idle-streams N` measures memory per open
stream instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from bench_load import BatchResult, Target, bucket_seconds
from bench_matrix import add_matrix, format_matrix
from bench_model import DEFAULT_MAX_TOKENS, SHAPES, BenchOptions, BenchReport, Party, Summary
from bench_procs import MODEL, cpu_seconds, raise_open_files_limit, rss_bytes
from bench_report import _mib, format_report, plot, report_json
from bench_targets import (
    Bench,
    SimSettings,
    add_router,
    find_fastapi_python,
    find_vllm_router,
    fleet,
    start_fastapi_proxy,
    start_loads,
    start_narwhal,
    start_vllm_router,
    wait_healthy,
)
from otlp_sink import otlp_sink


async def add_peers(bench: Bench, options: BenchOptions, say: Any) -> None:
    """Start the peer routers the options name, as targets after Narwhal."""
    if options.vllm_router is not None:
        starting = start_vllm_router(
            options.vllm_router, bench.producer_url, bench.consumer_url, bench.workdir
        )
        url = await add_router(bench, "vllm-router", starting)
        say(f"vllm-router: {url} (pid {bench.pids['vllm-router']}, {options.vllm_router})")
    if options.fastapi_proxy is not None:
        starting = start_fastapi_proxy(
            options.fastapi_proxy, bench.producer_url, bench.consumer_url, bench.workdir
        )
        url = await add_router(bench, "fastapi-proxy", starting)
        say(f"fastapi-proxy: {url} (pid {bench.pids['fastapi-proxy']}, {options.fastapi_proxy})")


# --- Running batches ----------------------------------------------------------------------


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (index < total % parts) for index in range(parts)]


async def run_batch(
    bench: Bench, target: Target, options: BenchOptions, requests: int
) -> tuple[BatchResult, dict[str, float]]:
    """One batch split over the load processes, with the CPU each party spent during it."""
    pid = bench.pids.get(target.name)
    before = {"producer": cpu_seconds(bench.producer.pid)}
    before["consumer"] = cpu_seconds(bench.consumer.pid)
    if pid is not None:
        before["router"] = cpu_seconds(pid)
    shares = zip(
        _split(requests, len(bench.loads)),
        _split(options.concurrency, len(bench.loads)),
        strict=True,
    )
    jobs = []
    offset = 0
    for load, (count, concurrency) in zip(bench.loads, shares, strict=True):
        job = {
            "job": "batch",
            "target": asdict(target),
            "requests": count,
            "concurrency": max(1, concurrency),
            "shape": options.shape,
            "max_tokens": options.max_tokens,
            "model": MODEL,
            "offset": offset,
        }
        offset += count
        jobs.append(load.ask(job))
    answers = await asyncio.gather(*jobs)
    spent = {"producer": cpu_seconds(bench.producer.pid) - before["producer"]}
    spent["consumer"] = cpu_seconds(bench.consumer.pid) - before["consumer"]
    if pid is not None:
        spent["router"] = cpu_seconds(pid) - before["router"]
        spent["rss"] = rss_bytes(pid)
    return _merge([_result(answer) for answer in answers]), spent


def _result(answer: dict[str, Any]) -> BatchResult:
    gaps = {int(bucket): count for bucket, count in answer.pop("gaps").items()}
    return BatchResult(**answer, gaps=gaps)


def _merge(results: list[BatchResult]) -> BatchResult:
    merged = BatchResult()
    for result in results:
        merged.ok += result.ok
        merged.errors += result.errors
        merged.error_samples += result.error_samples
        merged.tokens += result.tokens
        merged.wall_s = max(merged.wall_s, result.wall_s)
        merged.cpu_s += result.cpu_s
        merged.ttft_s += result.ttft_s
        merged.tpot_s += result.tpot_s
        for bucket, count in result.gaps.items():
            merged.gaps[bucket] = merged.gaps.get(bucket, 0) + count
    return merged


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


def _gap_percentile(gaps: dict[int, int], fraction: float) -> float | None:
    total = sum(gaps.values())
    if not total:
        return None
    seen = 0
    for bucket in sorted(gaps):
        seen += gaps[bucket]
        if seen >= fraction * total:
            return bucket_seconds(bucket)
    return None


def summarize(party: Party, direct: Summary | None) -> Summary:
    merged = _merge(party.results)
    wall = party.wall_s
    ttft_p50, ttft_p99 = _percentile(merged.ttft_s, 0.5), _percentile(merged.ttft_s, 0.99)
    tpot_p50 = _percentile(merged.tpot_s, 0.5) if merged.tpot_s else None

    def added(mine: float | None, theirs: float | None) -> float | None:
        if direct is None or party.name == direct.name or mine is None or theirs is None:
            return None
        return mine - theirs

    cpu = party.router_cpu_s
    tokens = max(1, party.tokens)
    return Summary(
        name=party.name,
        requests=party.ok,
        errors=party.errors,
        tokens=party.tokens,
        requests_per_s=party.ok / wall,
        tokens_per_s=party.tokens / wall,
        ttft_p50_s=ttft_p50,
        ttft_p99_s=ttft_p99,
        itl_p50_s=_gap_percentile(merged.gaps, 0.5),
        itl_p99_s=_gap_percentile(merged.gaps, 0.99),
        tpot_p50_s=tpot_p50,
        added_ttft_p50_s=added(ttft_p50, direct.ttft_p50_s if direct else None),
        added_ttft_p99_s=added(ttft_p99, direct.ttft_p99_s if direct else None),
        added_tpot_p50_s=added(tpot_p50, direct.tpot_p50_s if direct else None),
        router_cpu_s=cpu,
        router_cpu_s_per_1k_requests=None if cpu is None else cpu / max(1, party.ok) * 1000,
        router_cpu_s_per_1k_tokens=None if cpu is None else cpu / tokens * 1000,
        router_rss_bytes=party.rss_bytes,
        load_cpu_percent=100 * party.load_cpu_s / wall,
        load_cpu_s_per_1k_tokens=party.load_cpu_s / tokens * 1000,
        producer_cpu_percent=100 * party.producer_cpu_s / wall,
        consumer_cpu_percent=100 * party.consumer_cpu_s / wall,
        consumer_cpu_s_per_1k_tokens=party.consumer_cpu_s / tokens * 1000,
        error_samples=tuple(merged.error_samples[:5]),
    )


def sim_settings(options: BenchOptions, seqs: int, max_tokens: int) -> SimSettings:
    """Engines with room for every stream: sequences, KV blocks and context length."""
    max_model_len = max(8192, max_tokens + 1024)
    blocks_per_seq = math.ceil((max_tokens + 128) / 16) + 1
    return SimSettings(
        inter_token_s=options.inter_token_s,
        prefill_s_per_token=options.prefill_s_per_token,
        max_num_seqs=max(256, seqs + 64),
        num_kv_blocks=max(8192, 2 * seqs * blocks_per_seq),
        max_model_len=max_model_len,
    )


async def run_bench(options: BenchOptions, workdir: Path | None = None) -> BenchReport:
    """Start the fleet and the targets, run the interleaved trials, and summarize."""
    raise_open_files_limit()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        return await _run_bench(options, workdir)


async def _run_bench(options: BenchOptions, workdir: Path) -> BenchReport:
    settings = sim_settings(options, options.concurrency, options.max_tokens)
    say = _printer(options.quiet)
    async with contextlib.AsyncExitStack() as stack:
        traced = options.tracing or options.matrix
        sink = await stack.enter_async_context(otlp_sink()) if traced else None
        bench = await stack.enter_async_context(
            fleet(settings, options.producer_port, options.consumer_port, workdir)
        )
        report = await _run_targets(bench, options, say, sink[0] if sink else None)
        if sink is not None:
            say(f"traced routers sent {sink[1][0]} OTLP export requests")
        return report


async def _run_targets(
    bench: Bench, options: BenchOptions, say: Any, traces_to: str | None
) -> BenchReport:
    say(f"engines: producer {bench.producer_url}, consumer {bench.consumer_url}")
    if options.direct:
        direct = Target("direct", producer=bench.producer_url, consumer=bench.consumer_url)
        bench.targets.append(direct)
    if options.narwhal:
        whole = {"engine": {"nonstream_decode": "whole"}}
        mode = options.nonstream_decode
        first = start_narwhal(
            bench.producer_url,
            bench.consumer_url,
            bench.workdir,
            settings=whole if mode == "whole" else None,
        )
        url = await add_router(bench, "narwhal", first)
        say(f"narwhal: {url} (pid {bench.pids['narwhal']}, non-streaming decodes: {mode})")
        if mode == "both":
            second = start_narwhal(
                bench.producer_url,
                bench.consumer_url,
                bench.workdir,
                name="narwhal-whole",
                settings=whole,
            )
            url = await add_router(bench, "narwhal-whole", second)
            say(f"narwhal-whole: {url} (pid {bench.pids['narwhal-whole']})")
    if options.tracing:
        assert traces_to is not None
        traced = start_narwhal(
            bench.producer_url,
            bench.consumer_url,
            bench.workdir,
            name="narwhal-traced",
            traces_to=traces_to,
            sample_ratio=options.tracing_ratio,
        )
        url = await add_router(bench, "narwhal-traced", traced)
        say(f"narwhal-traced: {url}, spans to {traces_to}")
    if options.matrix:
        await add_matrix(bench, traces_to, say)
    await add_peers(bench, options, say)
    pids = dict(options.target_pids)
    for name, url in options.targets:
        # Another router may still be finding the engines the bench just started.
        await wait_healthy(None, url)
        bench.targets.append(Target(name, url=url))
        if name in pids:
            bench.pids[name] = pids[name]
    await start_loads(bench, options.load_processes)
    return await _trials(bench, options, say)


async def _trials(bench: Bench, options: BenchOptions, say: Any) -> BenchReport:
    parties = {target.name: Party(target.name) for target in bench.targets}
    if options.warmup:
        for target in bench.targets:
            await run_batch(bench, target, options, min(options.requests, 2 * options.concurrency))
    batches: list[dict[str, Any]] = []
    for trial in range(1, options.trials + 1):
        for target in bench.targets:
            result, spent = await run_batch(bench, target, options, options.requests)
            party = parties[target.name]
            party.results.append(result)
            party.producer_cpu_s += spent["producer"]
            party.consumer_cpu_s += spent["consumer"]
            if "router" in spent:
                party.router_cpu_s = (party.router_cpu_s or 0.0) + spent["router"]
                party.rss_bytes = max(party.rss_bytes or 0, int(spent["rss"]))
            batches.append(_batch_row(trial, target.name, result, spent))
            say(
                f"trial {trial} {target.name}: {result.ok} ok, {result.errors} errors, "
                f"{result.tokens / result.wall_s:,.0f} tokens/s"
            )
    direct = summarize(parties["direct"], None) if "direct" in parties else None
    summaries = tuple(
        direct if direct is not None and name == "direct" else summarize(party, direct)
        for name, party in parties.items()
    )
    return BenchReport(options, summaries, tuple(batches))


def _batch_row(
    trial: int, name: str, result: BatchResult, spent: dict[str, float]
) -> dict[str, Any]:
    return {
        "trial": trial,
        "target": name,
        "ok": result.ok,
        "errors": result.errors,
        "tokens": result.tokens,
        "wall_s": result.wall_s,
        "tokens_per_s": result.tokens / result.wall_s,
        "ttft_p50_s": _percentile(result.ttft_s, 0.5),
        "ttft_p99_s": _percentile(result.ttft_s, 0.99),
        "tpot_p50_s": _percentile(result.tpot_s, 0.5) if result.tpot_s else None,
        "load_cpu_s": result.cpu_s,
        **{f"{party}_cpu_s": seconds for party, seconds in spent.items() if party != "rss"},
        "router_rss_bytes": spent.get("rss"),
    }


def _printer(quiet: bool) -> Any:
    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    return say


# --- Idle streams -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IdleResult:
    target: str
    streams: int
    opened: int
    errors: int
    rss_before_bytes: int
    rss_open_bytes: int
    seconds_to_open: float
    router_in_flight: int | None
    samples: tuple[str, ...]

    @property
    def bytes_per_stream(self) -> float:
        return (self.rss_open_bytes - self.rss_before_bytes) / max(1, self.opened)


IDLE_INTERVAL_S = 1000.0


async def run_idle(options: BenchOptions, streams: int, workdir: Path) -> list[IdleResult]:
    """Open `streams` streams through each router and hold them after their first token.

    The consumer waits `IDLE_INTERVAL_S` between tokens, so every stream sits open and idle;
    the router's resident memory before and with them open gives the cost of one stream.
    """
    limit = raise_open_files_limit()
    say = _printer(options.quiet)
    # A router holds two sockets per stream (client and consumer), the load process one.
    if 2 * streams + 256 > limit:
        say(
            f"note: the open-files limit is {limit}; a router needs about two descriptors "
            f"per stream, so {streams} streams may not all open"
        )
    idle = replace(options, inter_token_s=IDLE_INTERVAL_S)
    settings = sim_settings(idle, streams, 16)
    results = []
    async with fleet(settings, options.producer_port, options.consumer_port, workdir) as bench:
        if options.narwhal:
            starting = start_narwhal(
                bench.producer_url, bench.consumer_url, workdir, idle=True, queue=streams
            )
            await add_router(bench, "narwhal", starting)
        await add_peers(bench, options, say)
        await start_loads(bench, 1)
        load = bench.loads[0]
        for target in bench.targets:
            pid = bench.pids[target.name]
            # Warm the router with complete one-token requests, so that the baseline holds
            # its pools and imports, not the streams.
            warm = replace(idle, max_tokens=1, concurrency=16)
            await run_batch(bench, target, warm, 64)
            before = rss_bytes(pid)
            started = time.perf_counter()
            job = {
                "job": "idle",
                "url": target.url,
                "streams": streams,
                "max_tokens": 16,
                "model": MODEL,
                "open_concurrency": 256,
                "open_timeout_s": 60.0 + streams / 50,
            }
            opened = await load.ask(job)
            seconds = time.perf_counter() - started
            await asyncio.sleep(1.0)  # let the router settle after the last first token
            assert target.url is not None
            result = IdleResult(
                target.name,
                streams,
                opened["open"],
                opened["errors"],
                before,
                rss_bytes(pid),
                seconds,
                await narwhal_in_flight(target.url),
                tuple(opened["samples"]),
            )
            await load.send({"release": True})
            await load.answer()
            results.append(result)
            say(
                f"{target.name}: {result.opened}/{streams} streams open in {seconds:.1f} s; "
                f"RSS {before / 2**20:.1f} MiB -> {result.rss_open_bytes / 2**20:.1f} MiB"
            )
            # Later targets share the consumer: let it drop the closed streams first.
            await asyncio.sleep(2.0)
    return results


async def narwhal_in_flight(url: str) -> int | None:
    """Requests Narwhal itself counts as in flight (None for other routers)."""
    with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
        async with aiohttp.ClientSession() as session, session.get(url + "/narwhal/state") as got:
            if got.status == 200:
                in_flight = orjson.loads(await got.read()).get("in_flight")
                return in_flight if isinstance(in_flight, int) else None
    return None


def format_idle(results: Iterable[IdleResult]) -> str:
    """Memory per open stream, and what 10,000 streams would take at that rate."""
    lines = [
        f"{'target':<14}{'open':>8}{'errors':>8}{'in flight':>11}{'open in':>9}"
        f"{'RSS before':>12}{'RSS open':>12}{'per stream':>12}{'10k streams':>13}"
    ]
    for r in results:
        per = r.bytes_per_stream
        in_flight = "n/a" if r.router_in_flight is None else str(r.router_in_flight)
        lines.append(
            f"{r.target:<14}{r.opened:>8}{r.errors:>8}{in_flight:>11}"
            f"{r.seconds_to_open:>7.1f} s{_mib(r.rss_before_bytes):>12}"
            f"{_mib(r.rss_open_bytes):>12}{per / 1024:>8.1f} KiB"
            f"{_mib(int(r.rss_before_bytes + 10_000 * per)):>13}"
        )
        lines += [f"  error: {sample}" for sample in r.samples]
    return "\n".join(lines)


# --- Command line ---------------------------------------------------------------------------


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _pid(text: str) -> tuple[str, int]:
    name, value = _pair(text)
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=PID, got {text!r}")
    return name, int(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="narwhal bench", description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--shape", choices=["stream", *SHAPES], default="stream", help="request shape")
    add("--max-tokens", type=int, help="output tokens per request (overrides the shape's)")
    add("--concurrency", type=int, default=64, help="concurrent clients")
    add("--requests", type=int, help="requests per batch (default: 32 per client, >= 1000)")
    add("--trials", type=int, default=3, help="interleaved trials (one batch per target)")
    add("--inter-token-s", type=float, default=0.0, help="the engines' decode step")
    add("--prefill-s-per-token", type=float, default=0.0, help="the engines' prefill cost")
    add("--no-direct", dest="direct", action="store_false", help="skip the direct path")
    add("--no-narwhal", dest="narwhal", action="store_false", help="skip Narwhal")
    add(
        "--nonstream-decode",
        choices=["stream", "whole", "both"],
        default="stream",
        help='Narwhal\'s engine.nonstream_decode; "both": also a "narwhal-whole" target',
    )
    add("--tracing", action="store_true", help="also run Narwhal with tracing on (OTLP to a sink)")
    add("--matrix", action="store_true", help="also run Narwhal with each optional feature flipped")
    add("--tracing-ratio", type=float, default=1.0, help="its sample ratio (with --tracing)")
    add("--vllm-router", type=Path, help="vllm-router binary (default: .venv-bench, PATH)")
    add("--no-vllm-router", action="store_true", help="skip vllm-router even if found")
    add("--fastapi-proxy", type=Path, help="python for the FastAPI peer (default: .venv-bench)")
    add("--no-fastapi-proxy", action="store_true", help="skip the FastAPI peer even if found")
    add("--target", type=_pair, action="append", default=[], help="NAME=URL of another router")
    add("--target-pid", type=_pid, action="append", default=[], help="NAME=PID for its CPU")
    add("--producer-port", type=int, default=0, help="fixed producer port for --target routers")
    add("--consumer-port", type=int, default=0, help="fixed consumer port for --target routers")
    add("--load-processes", type=int, default=1, help="load generator processes")
    add("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up batches")
    add("--idle-streams", type=int, help="measure router memory with N idle open streams")
    add("--json", type=Path, help="write every figure to this JSON file")
    add("--plot", type=Path, help="write a latency/throughput chart (needs matplotlib)")
    add("--workdir", type=Path, help="keep configs and logs here (default: a temp dir)")
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    max_tokens = args.max_tokens or SHAPES.get(args.shape, DEFAULT_MAX_TOKENS)
    shape = "stream" if args.shape in ("short", "long") else args.shape
    vllm_router = find_vllm_router(args.vllm_router) if not args.no_vllm_router else None
    fastapi = find_fastapi_python(args.fastapi_proxy) if not args.no_fastapi_proxy else None
    return BenchOptions(
        shape=shape,
        max_tokens=max_tokens,
        concurrency=args.concurrency,
        requests=args.requests or max(1000, 32 * args.concurrency),
        trials=args.trials,
        inter_token_s=args.inter_token_s,
        prefill_s_per_token=args.prefill_s_per_token,
        direct=args.direct,
        narwhal=args.narwhal,
        vllm_router=vllm_router,
        fastapi_proxy=fastapi,
        targets=tuple(args.target),
        target_pids=tuple(args.target_pid),
        producer_port=args.producer_port,
        consumer_port=args.consumer_port,
        load_processes=args.load_processes,
        warmup=args.warmup,
        tracing=args.tracing,
        matrix=args.matrix,
        tracing_ratio=args.tracing_ratio,
        nonstream_decode=args.nonstream_decode,
    )


async def _main(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        if args.idle_streams:
            results = await run_idle(options, args.idle_streams, workdir)
            print()
            print(format_idle(results))
            if args.json:
                rows = [{**asdict(r), "bytes_per_stream": r.bytes_per_stream} for r in results]
                args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
                print(f"figures written to {args.json}")
            return 1 if any(r.errors for r in results) else 0
        report = await run_bench(options, workdir)
    print()
    print(format_report(report))
    if options.matrix:
        print()
        print(format_matrix(report))
    if args.json:
        args.json.write_bytes(report_json(report))
        print(f"figures written to {args.json}")
    if args.plot:
        print(plot(report, args.plot))
    failed = any(s.errors for s in report.summaries)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run from the command line; the exit status is 1 when any request failed."""
    args = parser().parse_args(argv)
    return uvloop.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())

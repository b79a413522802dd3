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
import os
import re
import resource
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from bench_load import BatchResult, Target, bucket_seconds
from otlp_sink import otlp_sink

HERE = Path(__file__).resolve().parent
LOAD_SCRIPT = HERE / "bench_load.py"
BENCH_VENV = HERE.parent / ".venv-bench"
BENCH_VENV_ROUTER = BENCH_VENV / "bin" / "vllm-router"
FASTAPI_PROXY = HERE / "peers" / "fastapi_proxy.py"
FASTAPI_PROXY_NEEDS = ("fastapi", "httpx", "uvicorn", "uvloop", "httptools")
"""What the FastAPI peer imports; `make bench-setup` installs them in .venv-bench."""
MODEL = "narwhal-sim"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
START_TIMEOUT_S = 60.0
ANSWER_LIMIT = 256 * 2**20
"""Longest answer line from a load process: it carries every request's latencies."""

SHAPES = {"short": 64, "long": 1024, "mixed-nonstream": 256}
"""Output tokens per request for each shape (the mix varies them per request)."""
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """One benchmark run; the defaults are the 64-streams x 256-tokens comparison."""

    shape: str = "stream"
    max_tokens: int = DEFAULT_MAX_TOKENS
    concurrency: int = 64
    requests: int = 2048
    trials: int = 3
    inter_token_s: float = 0.0
    prefill_s_per_token: float = 0.0
    direct: bool = True
    narwhal: bool = True
    vllm_router: Path | None = None
    fastapi_proxy: Path | None = None
    targets: tuple[tuple[str, str], ...] = ()
    target_pids: tuple[tuple[str, int], ...] = ()
    producer_port: int = 0
    consumer_port: int = 0
    load_processes: int = 1
    warmup: bool = True
    quiet: bool = False
    # Also run Narwhal with tracing on ("narwhal-traced"), exporting to an OTLP sink.
    tracing: bool = False
    tracing_ratio: float = 1.0
    # Run Narwhal twice, stream continuation off ("narwhal") and on ("narwhal-continued").
    continuation: bool = False


@dataclass(slots=True)
class Party:
    """A target as measured over all its batches."""

    name: str
    results: list[BatchResult] = field(default_factory=list)
    router_cpu_s: float | None = None
    rss_bytes: int | None = None
    producer_cpu_s: float = 0.0
    consumer_cpu_s: float = 0.0

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.results)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.results)

    @property
    def load_cpu_s(self) -> float:
        return sum(r.cpu_s for r in self.results)


@dataclass(frozen=True, slots=True)
class Summary:
    """One target's figures; latencies in seconds, `None` where a figure does not apply."""

    name: str
    requests: int
    errors: int
    tokens: int
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float | None
    itl_p99_s: float | None
    tpot_p50_s: float | None
    added_ttft_p50_s: float | None
    added_ttft_p99_s: float | None
    added_tpot_p50_s: float | None
    router_cpu_s: float | None
    router_cpu_s_per_1k_requests: float | None
    router_cpu_s_per_1k_tokens: float | None
    router_rss_bytes: int | None
    load_cpu_percent: float
    load_cpu_s_per_1k_tokens: float
    producer_cpu_percent: float
    consumer_cpu_percent: float
    consumer_cpu_s_per_1k_tokens: float
    error_samples: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BenchReport:
    options: BenchOptions
    summaries: tuple[Summary, ...]
    batches: tuple[dict[str, Any], ...]

    def summary(self, name: str) -> Summary:
        return next(s for s in self.summaries if s.name == name)


# --- Processes --------------------------------------------------------------------------


class Proc:
    """A child process with its output in a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(
        cls, name: str, argv: Sequence[str], workdir: Path, *, stdin: bool = False
    ) -> Proc:
        log = workdir / f"{name}.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if stdin else out,
                stderr=out,
                limit=ANSWER_LIMIT,
            )
        return cls(name, process, log)

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def check_alive(self) -> None:
        if self.process.returncode is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}; its log ends:\n{self.tail()}"
            )

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10.0)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


class LoadProcess:
    """A `bench_load.py` process: one JSON job per line in, one JSON answer per line out."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    async def ask(self, job: dict[str, Any]) -> dict[str, Any]:
        await self.send(job)
        return await self.answer()

    async def send(self, job: dict[str, Any]) -> None:
        stdin = self.proc.process.stdin
        assert stdin is not None
        stdin.write(orjson.dumps(job) + b"\n")
        await stdin.drain()

    async def answer(self) -> dict[str, Any]:
        stdout = self.proc.process.stdout
        assert stdout is not None
        line = await stdout.readline()
        if not line:
            self.proc.check_alive()
            raise RuntimeError(f"{self.proc.name} closed its output; log:\n{self.proc.tail()}")
        answer: dict[str, Any] = orjson.loads(line)
        return answer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def raise_open_files_limit() -> int:
    """Lift the soft open-files limit to the hard one (children inherit it); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# --- Reading the OS -----------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """The process and every process below it (a router may run workers)."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(entry.path, "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of a process and its descendants, from /proc/<pid>/stat."""
    total = 0
    for member in _descendants(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants, from /proc/<pid>/statm."""
    total = 0
    for member in _descendants(pid):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{member}/statm").read_text().split()[1]) * PAGE_SIZE
    return total


# --- The fleet and the targets ------------------------------------------------------------

_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass(frozen=True, slots=True)
class SimSettings:
    inter_token_s: float
    prefill_s_per_token: float
    max_num_seqs: int
    num_kv_blocks: int
    max_model_len: int


async def start_sim(name: str, port: int, settings: SimSettings, workdir: Path) -> tuple[Proc, str]:
    """One `narwhal sim` process; returns it with the URL it printed."""
    argv = [
        *(sys.executable, "-m", "narwhal", "sim", "--id", name, "--port", str(port)),
        *("--inter-token-s", repr(settings.inter_token_s)),
        *("--prefill-s-per-token", repr(settings.prefill_s_per_token)),
        *("--request-overhead-s", "0", "--kv-pull-s-per-block", "0", "--slowdown-per-seq", "0"),
        *("--max-num-seqs", str(settings.max_num_seqs)),
        *("--num-kv-blocks", str(settings.num_kv_blocks)),
        *("--max-model-len", str(settings.max_model_len)),
    ]
    proc = await Proc.start(name, argv, workdir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = _LISTENING.search(proc.log.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        proc.check_alive()
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{name} did not start; log:\n{proc.tail()}")


async def wait_healthy(proc: Proc | None, url: str) -> None:
    """Poll GET /health until it answers 200; `proc` is None for a router we did not start."""
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc is not None:
                proc.check_alive()
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)
    log = f"; log:\n{proc.tail()}" if proc is not None else ""
    raise RuntimeError(f"{proc.name if proc else url} did not become healthy at {url}{log}")


def narwhal_config(
    producer: str,
    consumer: str,
    port: int,
    *,
    idle: bool = False,
    queue: int = 1024,
    traces_to: str | None = None,
    sample_ratio: float = 1.0,
    continuation: bool | None = None,
) -> str:
    """A fleet file for the two engines. Seats are unlimited, as the peers have no seat limit;
    idle streams need the silence check off and room to open thousands of first tokens.
    Tracing is off unless `traces_to` names an OTLP endpoint (the environment has no say)."""
    tracing = "enabled = false"
    if traces_to:
        tracing = f'enabled = true\nendpoint = "{traces_to}"\nsample_ratio = {sample_ratio}'
    continuation_table = ""
    if continuation is not None:
        continuation_table = f"\n[continuation]\nenabled = {str(continuation).lower()}\n"
    first_token_s = 120.0 if idle else 30.0
    decode_read_s = 0.0 if idle else 10.0
    request_s = 3600.0 if idle else 600.0
    return f"""\
model = "{MODEL}"

[server]
host = "127.0.0.1"
port = {port}

[engine]
first_token_timeout_s = {first_token_s}
decode_read_timeout_s = {decode_read_s}

[serving]
request_timeout_s = {request_s}
queue_capacity = {queue}

[tracing]
{tracing}
{continuation_table}

[[engines]]
id = "producer"
url = "{producer}"
role = "prefill"
max_prefill_seats = 0

[[engines]]
id = "consumer"
url = "{consumer}"
role = "decode"
max_decode_seats = 0
"""


async def start_narwhal(
    producer: str,
    consumer: str,
    workdir: Path,
    *,
    idle: bool = False,
    queue: int = 1024,
    name: str = "narwhal",
    traces_to: str | None = None,
    sample_ratio: float = 1.0,
    continuation: bool | None = None,
) -> tuple[Proc, str]:
    port = free_port()
    config = workdir / f"{name}.toml"
    config.write_text(
        narwhal_config(
            producer,
            consumer,
            port,
            idle=idle,
            queue=queue,
            traces_to=traces_to,
            sample_ratio=sample_ratio,
            continuation=continuation,
        )
    )
    argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(config), "--skip-preflight"]
    proc = await Proc.start(name, argv, workdir)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(proc, url)
    return proc, url


async def start_vllm_router(
    binary: Path, producer: str, consumer: str, workdir: Path
) -> tuple[Proc, str]:
    """vllm-router in its PD mode; round-robin, the cheapest policy it has, for a fair cost."""
    port = free_port()
    argv = [
        *(str(binary), "--vllm-pd-disaggregation"),
        *("--prefill", producer, "--decode", consumer),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--prometheus-port", str(free_port()), "--policy", "round_robin"),
        *("--worker-startup-check-interval", "1", "--log-level", "warning"),
    ]
    proc = await Proc.start("vllm-router", argv, workdir)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(proc, url)
    return proc, url


async def start_fastapi_proxy(
    python: Path, producer: str, consumer: str, workdir: Path
) -> tuple[Proc, str]:
    """The FastAPI + httpx peer (benchmarks/peers/fastapi_proxy.py) on uvicorn, one process."""
    port = free_port()
    argv = [
        *(str(python), str(FASTAPI_PROXY)),
        *("--prefill", producer, "--decode", consumer, "--port", str(port)),
    ]
    proc = await Proc.start("fastapi-proxy", argv, workdir)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(proc, url)
    return proc, url


def find_fastapi_python(explicit: Path | None) -> Path | None:
    """The given interpreter, else .venv-bench's when it has the FastAPI peer's packages."""
    if explicit is not None:
        return explicit
    python = BENCH_VENV / "bin" / "python"
    for site in BENCH_VENV.glob("lib/python3*/site-packages"):
        if python.exists() and all((site / name).is_dir() for name in FASTAPI_PROXY_NEEDS):
            return python
    return None


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


def find_vllm_router(explicit: Path | None) -> Path | None:
    """The given binary, else the one `make bench-setup` installs, else one on PATH."""
    if explicit is not None:
        return explicit
    if BENCH_VENV_ROUTER.exists():
        return BENCH_VENV_ROUTER
    found = shutil.which("vllm-router")
    return Path(found) if found else None


@dataclass(slots=True)
class Bench:
    """What a run started: engines, routers, load processes, and where each target is."""

    workdir: Path
    producer: Proc
    consumer: Proc
    producer_url: str
    consumer_url: str
    targets: list[Target] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    loads: list[LoadProcess] = field(default_factory=list)


@contextlib.asynccontextmanager
async def fleet(
    settings: SimSettings, producer_port: int, consumer_port: int, workdir: Path
) -> AsyncIterator[Bench]:
    """Start the producer and the consumer; stop everything the bench started on exit."""
    started: list[Proc] = []
    try:
        (producer, producer_url), (consumer, consumer_url) = await asyncio.gather(
            start_sim("producer", producer_port, settings, workdir),
            start_sim("consumer", consumer_port, settings, workdir),
        )
        started += [producer, consumer]
        bench = Bench(workdir, producer, consumer, producer_url, consumer_url, procs=started)
        yield bench
    finally:
        for proc in reversed(started):
            await proc.stop()


async def add_router(bench: Bench, name: str, starting: Awaitable[tuple[Proc, str]]) -> str:
    proc, url = await starting
    bench.procs.append(proc)
    bench.targets.append(Target(name, url=url))
    bench.pids[name] = proc.pid
    return url


async def start_loads(bench: Bench, count: int) -> None:
    for index in range(count):
        proc = await Proc.start(
            f"load-{index}", [sys.executable, str(LOAD_SCRIPT)], bench.workdir, stdin=True
        )
        bench.procs.append(proc)
        bench.loads.append(LoadProcess(proc))


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
        sink = await stack.enter_async_context(otlp_sink()) if options.tracing else None
        bench = await stack.enter_async_context(
            fleet(settings, options.producer_port, options.consumer_port, workdir)
        )
        report = await _run_targets(bench, options, say, sink[0] if sink else None)
        if sink is not None:
            say(f"narwhal-traced sent {sink[1][0]} OTLP export requests")
        return report


async def _run_targets(
    bench: Bench, options: BenchOptions, say: Any, traces_to: str | None
) -> BenchReport:
    say(f"engines: producer {bench.producer_url}, consumer {bench.consumer_url}")
    if options.direct:
        direct = Target("direct", producer=bench.producer_url, consumer=bench.consumer_url)
        bench.targets.append(direct)
    if options.narwhal:
        base = False if options.continuation else None
        started = start_narwhal(
            bench.producer_url, bench.consumer_url, bench.workdir, continuation=base
        )
        url = await add_router(bench, "narwhal", started)
        say(f"narwhal: {url} (pid {bench.pids['narwhal']})")
        if options.continuation:
            continued = start_narwhal(
                bench.producer_url,
                bench.consumer_url,
                bench.workdir,
                name="narwhal-continued",
                continuation=True,
            )
            url = await add_router(bench, "narwhal-continued", continued)
            say(f"narwhal-continued: {url} (stream continuation on)")
    if traces_to is not None:
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


# --- Reporting ------------------------------------------------------------------------------


def _ms(seconds: float | None, signed: bool = False) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1000:+.2f}" if signed else f"{seconds * 1000:.2f}"


def _us(seconds: float | None, signed: bool = False) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1e6:+.1f}" if signed else f"{seconds * 1e6:.1f}"


def _mib(size: int | None) -> str:
    return "n/a" if size is None else f"{size / 2**20:.1f} MiB"


def _number(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_report(report: BenchReport) -> str:
    """The tables: throughput and latency, then what each party spent."""
    o = report.options
    shape = o.shape if o.shape != "stream" else f"streaming, {o.max_tokens} tokens"
    head = (
        f"{o.concurrency} concurrent clients, {o.requests} requests per batch, "
        f"{o.trials} interleaved trials, {shape}, inter-token {o.inter_token_s:g} s, "
        f"{os.cpu_count()} cores"
    )
    latency = [
        f"{'':<14}{'':>9}{'':>10}{'TTFT ms':>20}{'+TTFT ms':>16}{'per token µs':>30}",
        f"{'target':<14}{'req/s':>9}{'tok/s':>10}{'p50':>10}{'p99':>10}{'p50':>8}{'p99':>8}"
        f"{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}{'+TPOT':>8}{'errors':>8}",
    ]
    for s in report.summaries:
        latency.append(
            f"{s.name:<14}{s.requests_per_s:>9.1f}{s.tokens_per_s:>10,.0f}"
            f"{_ms(s.ttft_p50_s):>10}{_ms(s.ttft_p99_s):>10}"
            f"{_ms(s.added_ttft_p50_s, True):>8}{_ms(s.added_ttft_p99_s, True):>8}"
            f"{_us(s.itl_p50_s):>9}{_us(s.itl_p99_s):>9}{_us(s.tpot_p50_s):>10}"
            f"{_us(s.added_tpot_p50_s, True):>8}{s.errors:>8}"
        )
    cost = [
        f"{'':<14}{'router CPU seconds':>31}{'':>12}{'load':>16}{'engines (consumer /1k tok)':>32}",
        f"{'target':<14}{'total':>8}{'/1k req':>10}{'/1k tok':>13}{'router RSS':>12}"
        f"{'CPU':>6}{'/1k tok':>10}{'producer':>10}{'consumer':>10}{'/1k tok':>12}",
    ]
    for s in report.summaries:
        cost.append(
            f"{s.name:<14}{_number(s.router_cpu_s, 2):>8}"
            f"{_number(s.router_cpu_s_per_1k_requests):>10}"
            f"{_number(s.router_cpu_s_per_1k_tokens, 5):>13}{_mib(s.router_rss_bytes):>12}"
            f"{s.load_cpu_percent:>5.0f}%{s.load_cpu_s_per_1k_tokens:>10.5f}"
            f"{s.producer_cpu_percent:>9.0f}%{s.consumer_cpu_percent:>9.0f}%"
            f"{s.consumer_cpu_s_per_1k_tokens:>12.5f}"
        )
    notes = [
        "+ columns: added over the direct path. ITL: gaps between token events as the client "
        "reads them; TPOT: each request's mean time per output token.",
        "CPU: user+system from /proc over each batch; load, producer and consumer CPU as a "
        "percentage of one core; RSS: the router's largest after a batch.",
    ]
    errors = [f"{s.name} error: {sample}" for s in report.summaries for sample in s.error_samples]
    return "\n".join([head, "", *latency, "", *cost, "", *notes, *errors])


def report_json(report: BenchReport) -> bytes:
    document = {
        "options": asdict(report.options),
        "targets": [asdict(summary) for summary in report.summaries],
        "batches": list(report.batches),
        "cpu_count": os.cpu_count(),
    }
    return orjson.dumps(document, option=orjson.OPT_INDENT_2, default=str)


def plot(report: BenchReport, path: Path) -> str:
    """A latency/throughput chart per batch, and the router CPU per token; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for index, s in enumerate(report.summaries):
        rows = [b for b in report.batches if b["target"] == s.name]
        throughput = [b["tokens_per_s"] for b in rows]
        color = f"C{index}"
        p50 = [b["ttft_p50_s"] * 1000 for b in rows]
        p99 = [b["ttft_p99_s"] * 1000 for b in rows]
        left.scatter(throughput, p50, color=color, label=f"{s.name} TTFT p50")
        left.scatter(throughput, p99, color=color, marker="x", label=f"{s.name} TTFT p99")
    left.set_xlabel("tokens/s relayed (one point per batch)")
    left.set_ylabel("client TTFT (ms)")
    left.legend(fontsize="small")
    costs = [s for s in report.summaries if s.router_cpu_s_per_1k_tokens is not None]
    right.bar([s.name for s in costs], [s.router_cpu_s_per_1k_tokens or 0.0 for s in costs])
    right.set_ylabel("router CPU s per 1,000 tokens")
    figure.suptitle(
        f"{report.options.concurrency} clients, {report.options.shape}, "
        f"{report.options.max_tokens} tokens"
    )
    figure.tight_layout()
    figure.savefig(path)
    return f"plot written to {path}"


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
    add("--tracing", action="store_true", help="also run Narwhal with tracing on (OTLP to a sink)")
    add("--tracing-ratio", type=float, default=1.0, help="its sample ratio (with --tracing)")
    add(
        "--continuation",
        action="store_true",
        help="run Narwhal with stream continuation off and on (narwhal-continued)",
    )
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
        tracing_ratio=args.tracing_ratio,
        continuation=args.continuation,
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

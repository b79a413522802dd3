"""The simulated fleet and the routers a benchmark drives: how each is started and found."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from bench_load import Target
from bench_procs import (
    BENCH_VENV,
    BENCH_VENV_ROUTER,
    FASTAPI_PROXY,
    FASTAPI_PROXY_NEEDS,
    LOAD_SCRIPT,
    MODEL,
    START_TIMEOUT_S,
    LoadProcess,
    Proc,
    free_port,
)

_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass(frozen=True, slots=True)
class SimSettings:
    inter_token_s: float
    prefill_s_per_token: float
    max_num_seqs: int
    num_kv_blocks: int
    max_model_len: int
    # A preset of `narwhal sim --profile` for every timing instead of the two above (which
    # then go unused), run `speed` times faster.
    profile: str | None = None
    speed: float = 1.0


def _timing_flags(settings: SimSettings) -> list[str]:
    if settings.profile is not None:
        return ["--profile", settings.profile, "--speed", repr(settings.speed)]
    return [
        *("--inter-token-s", repr(settings.inter_token_s)),
        *("--prefill-s-per-token", repr(settings.prefill_s_per_token)),
        *("--request-overhead-s", "0", "--kv-pull-s-per-block", "0", "--slowdown-per-seq", "0"),
    ]


async def start_sim(name: str, port: int, settings: SimSettings, workdir: Path) -> tuple[Proc, str]:
    """One `narwhal sim` process; returns it with the URL it printed."""
    argv = [
        *(sys.executable, "-m", "narwhal", "sim", "--id", name, "--port", str(port)),
        *_timing_flags(settings),
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


Settings = Mapping[str, Mapping[str, object]]
"""Configuration keys by table, e.g. `{"engine": {"metrics_interval_s": 0}}`."""


def narwhal_config(
    producer: str,
    consumer: str,
    port: int,
    *,
    idle: bool = False,
    queue: int = 1024,
    traces_to: str | None = None,
    sample_ratio: float = 1.0,
    settings: Settings | None = None,
    tenants: Sequence[Mapping[str, object]] = (),
    decode_seats: int = 0,
) -> str:
    """A fleet file for the two engines. Seats are unlimited, as the peers have no seat limit;
    idle streams need the silence check off and room to open thousands of first tokens.
    Tracing is off unless `traces_to` names an OTLP endpoint (the environment has no say).
    `settings` adds keys (or overrides these), table by table; `tenants` are `[[tenants]]`
    entries; `decode_seats` limits the consumer's seats (0: unlimited), so that requests
    wait in the router's queue rather than the engine's."""
    tracing: dict[str, object] = {"enabled": False}
    if traces_to:
        tracing = {"enabled": True, "endpoint": traces_to, "sample_ratio": sample_ratio}
    tables: dict[str, dict[str, object]] = {
        "server": {"host": "127.0.0.1", "port": port},
        "engine": {
            "first_token_timeout_s": 120.0 if idle else 30.0,
            "decode_read_timeout_s": 0.0 if idle else 10.0,
        },
        "serving": {"request_timeout_s": 3600.0 if idle else 600.0, "queue_capacity": queue},
        "tracing": tracing,
    }
    for table, keys in (settings or {}).items():
        tables.setdefault(table, {}).update(keys)
    engines = [
        {"id": "producer", "url": producer, "role": "prefill", "max_prefill_seats": 0},
        {"id": "consumer", "url": consumer, "role": "decode", "max_decode_seats": decode_seats},
    ]
    lines = [f"model = {_toml(MODEL)}"]
    for table, keys in tables.items():
        lines += ["", f"[{table}]", *(f"{key} = {_toml(value)}" for key, value in keys.items())]
    for engine in engines:
        lines += ["", "[[engines]]", *(f"{key} = {_toml(value)}" for key, value in engine.items())]
    for tenant in tenants:
        lines += ["", "[[tenants]]", *(f"{key} = {_toml(value)}" for key, value in tenant.items())]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    """A TOML scalar or array: JSON's spelling of strings and numbers is TOML's too."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    raise TypeError(f"no TOML value for {value!r}")


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
    settings: Settings | None = None,
    tenants: Sequence[Mapping[str, object]] = (),
    decode_seats: int = 0,
    workers: int = 1,
) -> tuple[Proc, str]:
    """`narwhal serve` over the two engines (`narwhal_config`), with `--workers` when
    `workers` is more than 1; returns it once `/health` answers, with its URL."""
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
            settings=settings,
            tenants=tenants,
            decode_seats=decode_seats,
        )
    )
    argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(config), "--skip-preflight"]
    if workers > 1:
        argv += ["--workers", str(workers)]
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

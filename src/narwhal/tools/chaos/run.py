"""Running a soak: a simulated fleet and a real router on loopback, the load and the faults,
then the settled router, the journal and the memory samples read for the report."""

from __future__ import annotations

import asyncio
import logging
import random
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.tools.chaos.checks import check_leaks, check_service, metrics_abandoned
from narwhal.tools.chaos.downtime import Downtime
from narwhal.tools.chaos.faults import Outages, inject
from narwhal.tools.chaos.load import MODEL, Load
from narwhal.tools.chaos.memory import memory_trend, rss_bytes
from narwhal.tools.chaos.options import ChaosOptions
from narwhal.tools.chaos.report import Report, format_report
from narwhal.tools.chaos.tally import Problems, Tally
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.options import SimOptions

# Quick engines, so that a run spends its time on faults rather than on simulated compute.
ENGINE = SimOptions(
    model=MODEL,
    faults_enabled=True,
    inter_token_s=0.002,
    prefill_s_per_token=0.00002,
    request_overhead_s=0.001,
    kv_pull_s_per_block=0.00005,
    slowdown_per_seq=0.0,
    kv_lease_s=30.0,
)
# Short timeouts and few seats, so that faults, retries, queueing and ejection all happen.
ROUTER: dict[str, Any] = {
    "server": {"client_timeout_s": 5.0},
    "engine": {
        "first_token_timeout_s": 0.8,
        "decode_read_timeout_s": 0.5,
        "prefill_timeout_s": 1.0,
        "connect_timeout_s": 0.5,
        "health_timeout_s": 0.5,
        "kv_lease_s": 30.0,
    },
    "serving": {
        "request_timeout_s": 4.0,
        "max_attempts": 2,
        "retry_budget": 20,
        "retry_replenish": 0.2,
        "queue_capacity": 32,
        "queue_timeout_s": 1.0,
    },
    "recovery": {"eject_after": 3, "readmit_interval_s": 0.3, "failure_quarantine_s": 0.1},
}
SEATS = {"max_prefill_seats": 8, "max_decode_seats": 16}
# With `--controller`: prompts cost real compute, so that the one prefill engine of a soak
# started with few is the pressured phase, and quick decisions, so that engines move while
# faults, retries and departures go on.
CONTROLLED_ENGINE: dict[str, Any] = {"prefill_s_per_token": 0.001}
CONTROLLER: dict[str, Any] = {
    "controller": {
        "enabled": True,
        "interval_s": 0.2,
        "window_s": 2.0,
        "dwell_s": 1.0,
        "cooldown_s": 1.0,
        "min_samples": 5,
        "ratio": 1.5,
        "min_pressure": 0.5,
    },
    "slo": {"ttft_s": 0.1, "tpot_s": 0.05},
}
SAMPLE_EVERY_S = 0.5
SETTLE_S = 15.0
FOLLOW_EVERY_S = 0.25


class JournalTail:
    """Reads the lines appended to a journal file since the last read (blocking)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as journal:
            journal.seek(self._offset)
            data = journal.read()
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        return [orjson.loads(line) for line in complete]


async def follow(tail: JournalTail, tally: Tally) -> None:
    """Feed the journal's lines to the tally as they are written."""
    while True:
        await asyncio.sleep(FOLLOW_EVERY_S)
        _feed(await asyncio.to_thread(tail.read), tally)


def _feed(lines: list[dict[str, Any]], tally: Tally) -> None:
    for line in lines:
        if line["type"] == "request":
            tally.add_line(line)
        elif line["type"] == "engine":
            tally.add_engine_line(line)


class _Failures(logging.Handler):
    """Collects every ERROR log record, wherever it comes from."""

    def __init__(self, problems: Problems) -> None:
        super().__init__(logging.ERROR)
        self.problems = problems

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({record.exc_info[1]!r})"
        self.problems.add([text])


async def run_chaos(options: ChaosOptions) -> Report:
    """Run the soak and judge it; the report says what happened and what failed."""
    roles = [(f"prefill-{i}", "prefill") for i in range(options.prefill)]
    roles += [(f"decode-{i}", "decode") for i in range(options.decode)]
    downtime = Downtime({phase: [name for name, r in roles if r == phase] for _, phase in roles})
    pinned = frozenset({"decode-0"} if options.controller and options.decode > 1 else ())
    tally = Tally(options.seed, ROUTER["serving"]["max_attempts"], downtime, pinned)
    report = Report(options, tally)
    failures = _Failures(report.unhandled)
    root = logging.getLogger()
    root.addHandler(failures)
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(
        lambda _, context: failures.problems.add(
            [f"asyncio: {context.get('message')} {context.get('exception')!r}"]
        )
    )
    try:
        with tempfile.TemporaryDirectory(prefix="narwhal-chaos-") as scratch:
            await _run(options, roles, downtime, report, Path(scratch) / "journal.jsonl", pinned)
    finally:
        root.removeHandler(failures)
        loop.set_exception_handler(previous)
    return report


async def _run(
    options: ChaosOptions,
    roles: list[tuple[str, str]],
    downtime: Downtime,
    report: Report,
    journal: Path,
    pinned: frozenset[str],
) -> None:
    engines: dict[str, SimEngine] = {}
    outages = Outages(engines, random.Random(options.seed + 1), downtime)
    for name, _ in roles:
        engines[name] = SimEngine(
            replace(ENGINE, name=name, **(CONTROLLED_ENGINE if options.controller else {})),
            on_crash=partial(outages.crashed, name),
            on_listening=partial(outages.listening, name),
        )
    async with asyncio.TaskGroup() as group:
        for engine in engines.values():
            group.create_task(engine.start())

    def role(name: str, phase: str) -> dict[str, Any]:
        if not options.controller:
            return {"role": phase}
        return {"role": "both", "start_as": phase, "pin": name in pinned}

    config = parse_config(
        {
            "model": MODEL,
            **ROUTER,
            **(CONTROLLER if options.controller else {}),
            "continuation": {"enabled": options.continuation},
            "journal": {"path": str(journal)},
            "engines": [
                {"id": name, "url": engines[name].url, **role(name, phase), **SEATS}
                for name, phase in roles
            ],
        },
        source="narwhal chaos",
    )
    server = RouterServer(config, "127.0.0.1", 0)
    await server.start()
    tail = JournalTail(journal)
    samples: list[tuple[float, int]] = []
    started = _now()
    try:
        background = [
            asyncio.create_task(_sample(samples)),
            asyncio.create_task(follow(tail, report.tally)),
            asyncio.create_task(
                inject(
                    engines,
                    outages,
                    random.Random(options.seed),
                    options.fault_every_s,
                    report.faults,
                )
            ),
        ]
        load = Load(server.url, options, report.tally, config.serving.request_timeout_s + 10)
        until = None if options.minutes is None else started + options.minutes * 60
        try:
            await load.run(until)
        finally:
            report.duration_s = _now() - started
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        for engine in engines.values():
            engine.clear_faults()
        await outages.end()
        report.unhandled.add(outages.errors)
        report.state = await _settled(server.url)
        report.abandoned = metrics_abandoned(await _metrics(server.url))
        report.trend = memory_trend(samples)
    finally:
        try:
            await server.stop()
        except Exception as exc:
            report.unhandled.add([f"stopping the router failed: {exc!r}"])
        async with asyncio.TaskGroup() as group:
            for engine in engines.values():
                group.create_task(engine.stop())
    # The router has stopped, so its journal is complete.
    _feed(await asyncio.to_thread(tail.read), report.tally)
    report.tally.finish()


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _sample(samples: list[tuple[float, int]]) -> None:
    while True:
        samples.append((time.monotonic(), rss_bytes()))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def _settled(url: str) -> dict[str, Any]:
    """`/narwhal/state` once nothing is left and every engine is back in service (or as it
    stands after `SETTLE_S`)."""
    state: dict[str, Any] = {}
    deadline = _now() + SETTLE_S
    async with aiohttp.ClientSession() as http:
        while _now() < deadline:
            async with http.get(url + "/narwhal/state") as response:
                state = await response.json()
            if not check_leaks(state) and not check_service(state):
                break
            await asyncio.sleep(0.05)
    return state


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        return await response.text()


async def chaos_command(options: ChaosOptions) -> int:
    """`narwhal chaos`: print the report; exit 1 when any check failed."""
    report = await run_chaos(options)
    print(format_report(report))
    return 0 if report.ok else 1

"""`narwhal chaos`: a soak of a simulated fleet and a real router under random faults.

Clients send a steady concurrent load over loopback, some leaving part-way; engines
misbehave in every way the simulator knows, and crash and come back. At the end the run is
judged on what the router promises: one journal line per request, statuses that follow
from their causes, clients seeing what the journal says, nothing left in flight, steady
memory and no unhandled exception. The seed fixes every random choice, not the timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson

from narwhal.config import parse_config
from narwhal.protocol.errors import Cause
from narwhal.protocol.sse import SseDecoder
from narwhal.router.app import RouterServer
from narwhal.sim.engine import SimEngine
from narwhal.sim.faults import Fault
from narwhal.sim.options import SimOptions

MODEL = "narwhal-sim"
ROUTES = ("/v1/completions", "/v1/chat/completions")
CLIENT_CLOSED = 499
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
# Prompts are drawn from a few words: endless new words would only grow the engines' caches.
WORDS = ("the", "sea", "is", "deep", "and", "wide", "whales", "sing", "under", "grey", "skies")
SAMPLE_EVERY_S = 0.5
WARM_UP_SHARE = 0.3
SETTLE_S = 15.0
FOLLOW_EVERY_S = 0.25
SHOWN_PROBLEMS = 5
# A client told to come back later (429, 503) waits a moment, as `Retry-After` asks.
BACKOFF_S = 0.1


@dataclass(frozen=True, slots=True)
class ChaosOptions:
    """One run: `requests` in all, or as many as fit in `minutes` when that is given."""

    requests: int = 1000
    minutes: float | None = None
    seed: int = 0
    prefill: int = 2
    decode: int = 2
    concurrency: int = 32
    fault_every_s: float = 0.2  # mean time between injected faults
    leave_share: float = 0.1  # clients that give up part-way


# Faults -----------------------------------------------------------------------------------

FaultDraw = Callable[[random.Random], dict[str, object]]


def _silence(rng: random.Random) -> dict[str, object]:
    return {
        "phase": "decode",
        "silence_after": rng.randint(0, 4),
        "silence_s": rng.uniform(0.2, 1.0),
        "silence_metadata": rng.random() < 0.5,
    }


# Every fault the simulator has, each drawn with its own random shape. `crash` drops the
# engine when a request trips it; the run restarts it a little later.
FAULTS: dict[str, FaultDraw] = {
    "status": lambda rng: {
        "phase": rng.choice(["prefill", "decode"]),
        "status": rng.choice([400, 429, 500, 502, 503, 504]),
    },
    "hang_s": lambda rng: {
        "phase": rng.choice(["prefill", "decode"]),
        "hang_s": rng.uniform(0.2, 1.5),
    },
    "first_token_delay_s": lambda rng: {
        "phase": "decode",
        "first_token_delay_s": rng.uniform(0.1, 1.2),
    },
    "silence": _silence,
    "close_after": lambda rng: {"phase": "decode", "close_after": rng.randint(0, 4)},
    "done_before_token": lambda rng: {"phase": "decode", "done_before_token": True},
    "error_after": lambda rng: {
        "phase": "decode",
        "error_after": rng.randint(0, 4),
        "error_code": rng.choice([400, 429, 500, 503]),
    },
    "descriptor": lambda rng: {
        "phase": "prefill",
        "descriptor": rng.choice(
            ["missing_engine_id", "non_integer_block_ids", "negative_block_ids", "null"]
        ),
    },
    "kv_pull_delay_s": lambda rng: {"phase": "decode", "kv_pull_delay_s": rng.uniform(0.05, 1.0)},
    "kv_pull_fail": lambda rng: {"phase": "decode", "kv_pull_fail": True},
    "refuse_s": lambda rng: {"refuse_s": rng.uniform(0.1, 1.0)},
    "crash": lambda rng: {"phase": rng.choice(["prefill", "decode"]), "crash": True},
}
OUTAGE = "outage"  # not a fault but an act: crash() an engine now, restart() it later


class Outages:
    """Takes engines down and brings them back, one outage at a time per engine."""

    def __init__(self, engines: Mapping[str, SimEngine], rng: random.Random) -> None:
        self._engines = engines
        self._rng = rng
        self._down: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.errors: list[str] = []

    def crashed(self, name: str) -> None:
        """A `crash` fault fired: the engine is gone until restarted."""
        self._start(name, crash=False)

    def outage(self, name: str) -> None:
        self._start(name, crash=True)

    def _start(self, name: str, *, crash: bool) -> None:
        if name in self._down:
            return
        self._down.add(name)
        task = asyncio.create_task(self._cycle(name, crash, self._rng.uniform(0.2, 1.5)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cycle(self, name: str, crash: bool, down_s: float) -> None:
        engine = self._engines[name]
        try:
            if crash:
                await engine.crash()
            await asyncio.sleep(down_s)
            await engine.restart()
        except Exception as exc:
            self.errors.append(f"restarting engine {name} failed: {exc!r}")
        finally:
            self._down.discard(name)

    async def end(self) -> None:
        """Wait until every engine taken down is back."""
        while self._tasks:
            await asyncio.gather(*self._tasks)


async def inject(
    engines: Mapping[str, SimEngine],
    outages: Outages,
    rng: random.Random,
    every_s: float,
    counts: Counter[str],
) -> None:
    """Arm a random fault (or cause an outage) on a random engine, until cancelled."""
    kinds = [*FAULTS, OUTAGE]
    while True:
        await asyncio.sleep(rng.expovariate(1 / every_s))
        name = rng.choice(sorted(engines))
        kind = rng.choice(kinds)
        counts[kind] += 1
        if kind == OUTAGE:
            outages.outage(name)
        else:
            fault = Fault.from_json({**FAULTS[kind](rng), "times": rng.randint(1, 3)})
            engines[name].set_fault(fault)


# Clients ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Sent:
    """One client request as its client saw it.

    `status` is the HTTP status, or None when the client left before it; `terminal` the
    code of the error event that ended a 200 stream; `broken` what went wrong when the
    connection failed under a client that did not leave.
    """

    index: int
    stream: bool
    left: bool = False
    hung: bool = False
    broken: str | None = None
    status: int | None = None
    terminal: int | None = None

    @property
    def seen(self) -> int | None:
        """The status the client was told, a terminal event's code included."""
        return self.terminal if self.terminal is not None else self.status


def _body(rng: random.Random, route: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(4, 24), "stream": stream}
    text = " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))
    if route == ROUTES[0]:
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        # Short stop strings end some answers early, some before any text at all.
        body["stop"] = [rng.choice(["e", "th", " s"])]
    return body


def terminal_code(raw: bytes) -> int | None:
    """The code of the error event ending a stream, or None when it ended cleanly."""
    events = [event.data for event in SseDecoder(max_event_bytes=1 << 30).feed(raw)]
    if len(events) < 2 or events[-1] != b"[DONE]":
        return None
    try:
        last = orjson.loads(events[-2])
    except orjson.JSONDecodeError:
        return None
    error = last.get("error") if isinstance(last, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) else None


class Load:
    """Concurrent clients over one connection pool; each request's choices come from the
    seed and its index alone, so they do not depend on scheduling."""

    def __init__(
        self, url: str, options: ChaosOptions, tally: Tally, give_up_after_s: float
    ) -> None:
        self.url = url
        self.options = options
        self.tally = tally
        self._give_up_after_s = give_up_after_s
        self._index = itertools.count()

    async def run(self, until: float | None) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(_body_sent)
        connector = aiohttp.TCPConnector(limit=0)
        async with (
            aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as http,
            asyncio.TaskGroup() as group,
        ):
            for _ in range(self.options.concurrency):
                group.create_task(self._client(http, until))

    async def _client(self, http: aiohttp.ClientSession, until: float | None) -> None:
        while True:
            index = next(self._index)
            if until is None and index >= self.options.requests:
                return
            if until is not None and _now() >= until:
                return
            sent = await self._one(http, index)
            self.tally.add_sent(sent)
            if sent.status in (429, 503):
                await asyncio.sleep(BACKOFF_S)

    async def _one(self, http: aiohttp.ClientSession, index: int) -> Sent:
        rng = random.Random(f"{self.options.seed}:{index}")
        route = rng.choice(ROUTES)
        sent = Sent(index, stream=rng.random() < 0.6)
        raw = orjson.dumps(_body(rng, route, sent.stream))
        leave = rng.random() < self.options.leave_share
        # A client leaves before its answer (only once its body is out, so that the router
        # has the request) or, streaming, after the first bytes of it.
        early = leave and (not sent.stream or rng.random() < 0.5)
        linger_s = rng.uniform(0.0, 0.6)
        body_sent = asyncio.Event()
        exchange = asyncio.create_task(
            self._exchange(http, route, raw, sent, leave=leave, early=early, body_sent=body_sent)
        )
        if early:
            out = asyncio.create_task(body_sent.wait())
            await asyncio.wait([exchange, out], return_when=asyncio.FIRST_COMPLETED)
            out.cancel()
            await asyncio.wait([exchange], timeout=linger_s)
            if not exchange.done():
                sent.left = True
                exchange.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await exchange
        return sent

    async def _exchange(
        self,
        http: aiohttp.ClientSession,
        route: str,
        raw: bytes,
        sent: Sent,
        *,
        leave: bool,
        early: bool,
        body_sent: asyncio.Event,
    ) -> None:
        """Send and read one request. A client leaving early asks for `100 Continue` first,
        so its body (and so the request) reaches the router's handler before it leaves."""
        headers = {"Content-Type": "application/json", "X-Request-Id": self.tally.id_of(sent)}
        timeout = aiohttp.ClientTimeout(total=self._give_up_after_s)
        try:
            async with http.post(
                self.url + route,
                data=raw,
                headers=headers,
                timeout=timeout,
                expect100=early,
                trace_request_ctx=SimpleNamespace(sent=body_sent),
            ) as response:
                sent.status = response.status
                if leave and not early and response.status == 200:
                    first = await response.content.readany()
                    if first and not response.content.at_eof():
                        sent.left = True
                        response.close()
                        return
                    body = first + await response.read()
                else:
                    body = await response.read()
                if sent.stream and response.status == 200:
                    sent.terminal = terminal_code(body)
        except TimeoutError:
            sent.hung = True
        except aiohttp.ClientError as exc:
            sent.broken = repr(exc)


async def _body_sent(
    session: aiohttp.ClientSession,
    context: SimpleNamespace,
    params: aiohttp.TraceRequestChunkSentParams,
) -> None:
    context.trace_request_ctx.sent.set()


# Judging a run ----------------------------------------------------------------------------

_TIMEOUT_CAUSES = {
    Cause.DEADLINE,
    Cause.PREFILL_TIMEOUT,
    Cause.FIRST_TOKEN_TIMEOUT,
    Cause.SILENCE,
    Cause.HANDOFF_EXPIRED,
}
_BAD_GATEWAY_CAUSES = {
    Cause.CONNECT,
    Cause.CLOSED_EARLY,
    Cause.DONE_BEFORE_TOKEN,
    Cause.BAD_RESPONSE,
    Cause.DESCRIPTOR,
}
_OUTCOMES = {200: "ok", CLIENT_CLOSED: "client_closed", 504: "timeout"}


def status_allowed(status: int, cause: str | None) -> bool:
    """The rules: each cause answers with the statuses it may have, and no other."""
    if cause is None:
        return status in (200, CLIENT_CLOSED)
    if cause == Cause.BAD_REQUEST:
        return 400 <= status < 500 and status != CLIENT_CLOSED
    if cause == Cause.UNAVAILABLE:
        return status in (429, 503)
    if cause in _TIMEOUT_CAUSES:
        return status == 504
    if cause in _BAD_GATEWAY_CAUSES:
        return status == 502
    if cause == Cause.HTTP_STATUS:
        return status in (502, 504)
    if cause == Cause.ERROR_OBJECT:
        # An error object keeps its own status; a client-fault one is filed as bad_request.
        return 400 <= status <= 599 and status not in (400, 413, 422, CLIENT_CLOSED)
    return False


def line_problems(line: Mapping[str, Any], max_attempts: int) -> list[str]:
    """What is wrong with one journal line on its own: its status against its cause, its
    outcome and error against its status, its attempts against the limit."""
    status, cause, rid = line["status"], line["cause"], line["client_request_id"]
    problems = []
    if not status_allowed(status, cause):
        problems.append(f"{rid}: status {status} for cause {cause}")
    outcome = _OUTCOMES.get(status, "client_error" if status < 500 else "error")
    if line["outcome"] != outcome:
        problems.append(f"{rid}: outcome {line['outcome']} for status {status}")
    if (line["error"] is None) != (status == 200):
        problems.append(f"{rid}: error {line['error']!r} with status {status}")
    if line["attempts"] > max_attempts:
        problems.append(f"{rid}: {line['attempts']} attempts, over {max_attempts}")
    return problems


def view_problems(sent: Sent, line: Mapping[str, Any]) -> list[str]:
    """A client that stayed was told what its journal line says; 499 only if it left."""
    rid, status = line["client_request_id"], line["status"]
    if status == CLIENT_CLOSED and not sent.left:
        return [f"{rid}: journaled 499 but its client stayed"]
    if not sent.left and sent.seen != status:
        return [f"{rid}: the client was told {sent.seen}, the journal says {status}"]
    return []


def check_leaks(state: Mapping[str, Any]) -> list[str]:
    """Nothing in flight, queued, held open to an engine, or seated, once the load is over."""
    problems = [
        f"{key} = {state[key]}" for key in ("in_flight", "queued", "open_engine_legs") if state[key]
    ]
    for engine in state["engines"]:
        for phase in ("prefill", "decode"):
            seats = engine["seats"][phase]["in_use"]
            if seats:
                problems.append(f"engine {engine['id']} holds {seats} {phase} seats")
    return problems


def check_service(state: Mapping[str, Any]) -> list[str]:
    """Once faults stop and engines are back up, readmission returns every one to service."""
    return [
        f"engine {engine['id']} is {engine['state']}: {engine['ejection_reason']}"
        for engine in state["engines"]
        if engine["state"] != "admitted"
    ]


@dataclass(slots=True)
class Problems:
    """How many problems a check found, and the first few of them."""

    count: int = 0
    shown: list[str] = field(default_factory=list)

    def add(self, problems: Iterable[str]) -> None:
        for problem in problems:
            self.count += 1
            if len(self.shown) < SHOWN_PROBLEMS:
                self.shown.append(problem)


class Tally:
    """Judges each request once both its client's view and its journal line are in, then
    keeps only counts: a long run's memory does not grow with its number of requests."""

    def __init__(self, seed: int, max_attempts: int) -> None:
        self._prefix = f"chaos-{seed}-"
        self._max_attempts = max_attempts
        self._sent: dict[int, Sent] = {}
        self._lines: dict[int, dict[str, Any]] = {}
        self._judged = bytearray()
        self.requests = self.lines = self.left = self.closed = self.terminal = 0
        self.outcomes: Counter[tuple[int, str]] = Counter()
        self.once = Problems()
        self.rules = Problems()
        self.views = Problems()

    def id_of(self, sent: Sent) -> str:
        return f"{self._prefix}{sent.index}"

    def add_sent(self, sent: Sent) -> None:
        self.requests += 1
        self.left += sent.left
        self.terminal += sent.terminal is not None
        if sent.hung:
            self.once.add([f"{self.id_of(sent)}: no answer within the client's patience"])
        if sent.broken is not None and not sent.left:
            self.once.add([f"{self.id_of(sent)}: the connection failed: {sent.broken}"])
        line = self._lines.pop(sent.index, None)
        if line is None:
            self._sent[sent.index] = sent
        else:
            self._judge(sent, line)

    def add_line(self, line: dict[str, Any]) -> None:
        self.lines += 1
        self.outcomes[line["status"], line["cause"] or line["outcome"]] += 1
        self.closed += line["status"] == CLIENT_CLOSED
        self.rules.add(line_problems(line, self._max_attempts))
        rid = line["client_request_id"]
        index = self._index_of(rid)
        if index is None:
            self.once.add([f"{rid}: journaled but never sent"])
        elif self._was_judged(index) or index in self._lines:
            self.once.add([f"{rid}: journaled twice"])
        elif index in self._sent:
            self._judge(self._sent.pop(index), line)
        else:
            self._lines[index] = line

    def finish(self) -> None:
        """Once every line is in: requests left without one, lines left without a request."""
        self.once.add(f"{self.id_of(s)}: no journal line" for s in self._sent.values())
        self.once.add(f"{line['client_request_id']}: never sent" for line in self._lines.values())

    def _index_of(self, rid: object) -> int | None:
        if not isinstance(rid, str) or not rid.startswith(self._prefix):
            return None
        digits = rid.removeprefix(self._prefix)
        return int(digits) if digits.isdigit() else None

    def _was_judged(self, index: int) -> bool:
        return index < len(self._judged) and self._judged[index] == 1

    def _judge(self, sent: Sent, line: Mapping[str, Any]) -> None:
        if len(self._judged) <= sent.index:
            self._judged.extend(bytes(sent.index + 1 - len(self._judged)))
        self._judged[sent.index] = 1
        if not sent.hung:
            self.views.add(view_problems(sent, line))


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
    """Feed the request lines of the journal to the tally as they are written."""
    while True:
        await asyncio.sleep(FOLLOW_EVERY_S)
        for line in await asyncio.to_thread(tail.read):
            if line["type"] == "request":
                tally.add_line(line)


@dataclass(frozen=True, slots=True)
class Trend:
    """RSS after warm-up: where it started and ended, its fitted slope and the allowed growth."""

    start_mb: float
    end_mb: float
    slope_mb_per_min: float
    growth_mb: float
    bound_mb: float
    samples: int

    @property
    def stable(self) -> bool:
        return self.growth_mb <= self.bound_mb


def memory_trend(samples: Sequence[tuple[float, int]]) -> Trend:
    """Least-squares slope of RSS over time after the warm-up share of the samples.

    Growth is that slope over the measured span; it may be at most 16 MB or a tenth of the
    starting RSS, whichever is more, so noise passes and a per-request leak does not.
    """
    kept = samples[int(len(samples) * WARM_UP_SHARE) :]
    if len(kept) < 3:
        return Trend(0.0, 0.0, 0.0, 0.0, math.inf, len(kept))
    times = [t for t, _ in kept]
    sizes = [rss / 2**20 for _, rss in kept]
    mean_t, mean_s = sum(times) / len(times), sum(sizes) / len(sizes)
    spread = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (s - mean_s) for t, s in zip(times, sizes, strict=True)) / spread
    growth = slope * (times[-1] - times[0])
    bound = max(16.0, sizes[0] / 10)
    return Trend(sizes[0], sizes[-1], slope * 60, growth, bound, len(kept))


def rss_bytes() -> int:
    """This process's resident set size (Linux `/proc`; elsewhere the peak, from rusage)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


# The run ----------------------------------------------------------------------------------


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

    @property
    def checks(self) -> dict[str, Problems]:
        leaks, service, memory = Problems(), Problems(), Problems()
        unsettled = ["the router's state was never read"]
        leaks.add(check_leaks(self.state) if self.state else unsettled)
        service.add(check_service(self.state) if self.state else unsettled)
        if self.trend is None or not self.trend.stable:
            memory.add(["RSS grew past its bound"])
        return {
            "one outcome per request": self.tally.once,
            "statuses follow the rules": self.tally.rules,
            "clients saw what the journal says": self.tally.views,
            "nothing left in flight": leaks,
            "every engine back in service": service,
            "memory stable": memory,
            "no unhandled exception": self.unhandled,
        }

    @property
    def ok(self) -> bool:
        return not any(problems.count for problems in self.checks.values())


async def run_chaos(options: ChaosOptions) -> Report:
    """Run the soak and judge it; the report says what happened and what failed."""
    report = Report(options, Tally(options.seed, ROUTER["serving"]["max_attempts"]))
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
            await _run(options, report, Path(scratch) / "journal.jsonl")
    finally:
        root.removeHandler(failures)
        loop.set_exception_handler(previous)
    return report


async def _run(options: ChaosOptions, report: Report, journal: Path) -> None:
    roles = [(f"prefill-{i}", "prefill") for i in range(options.prefill)]
    roles += [(f"decode-{i}", "decode") for i in range(options.decode)]
    engines: dict[str, SimEngine] = {}
    outages = Outages(engines, random.Random(options.seed + 1))
    for name, _ in roles:
        on_crash = partial(outages.crashed, name)
        engines[name] = SimEngine(replace(ENGINE, name=name), on_crash=on_crash)
    async with asyncio.TaskGroup() as group:
        for engine in engines.values():
            group.create_task(engine.start())
    config = parse_config(
        {
            "model": MODEL,
            **ROUTER,
            "journal": {"path": str(journal)},
            "engines": [
                {"id": name, "url": engines[name].url, "role": role, **SEATS}
                for name, role in roles
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
    for line in await asyncio.to_thread(tail.read):
        if line["type"] == "request":
            report.tally.add_line(line)
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


# The report -------------------------------------------------------------------------------


def format_report(report: Report) -> str:
    options, tally = report.options, report.tally
    out = [
        f"narwhal chaos: seed {options.seed}, {options.prefill} prefill + {options.decode} "
        f"decode engines, {tally.requests} requests from {options.concurrency} clients "
        f"in {report.duration_s:.1f} s",
        f"faults injected ({sum(report.faults.values())}):",
    ]
    out += [f"  {kind:<22}{count:>8}" for kind, count in sorted(report.faults.items())]
    out.append(f"outcomes ({tally.lines} journal lines):")
    out += [
        f"  {status} {cause:<20}{n:>7}" for (status, cause), n in sorted(tally.outcomes.items())
    ]
    out.append(
        f"clients: {tally.left} left part-way ({tally.closed} journaled as 499), "
        f"{tally.terminal} streams ended with a terminal error event"
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
    out.append(f"unhandled exceptions: {report.unhandled.count}")
    out.append("checks:")
    for name, problems in report.checks.items():
        out.append(f"  {'FAIL' if problems.count else 'PASS'} {name}")
        out += [f"       {problem}" for problem in problems.shown]
        if problems.count > len(problems.shown):
            out.append(f"       ... and {problems.count - len(problems.shown)} more")
    return "\n".join(out)


async def chaos_command(options: ChaosOptions) -> int:
    """`narwhal chaos`: print the report; exit 1 when any check failed."""
    report = await run_chaos(options)
    print(format_report(report))
    return 0 if report.ok else 1

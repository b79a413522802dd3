"""Router CPU per request on the Responses route against chat, and on the other routes
against the code before the Responses route, on the bench's simulated fleet.

    .venv/bin/python benchmarks/responses_cpu.py [--requests 2000] [--trials 5]
        [--concurrency 64] [--max-tokens 64] [--shapes chat-stream,responses-stream,...]
        [--baseline OLD/src] [--json out.json] [--workdir DIR]

The fleet is the bench's own: one producer and one consumer `narwhal sim` process answering
at once, with room for every request. The router, "now", is `narwhal serve` of this tree;
its stored responses go to a SQLite file in the run's directory (the default store). Each
shape is a batch of `--requests` requests from `--concurrency` clients, every answer
checked (its tokens, a stream's end); the load runs in this process, and the router's CPU
is its own process's, read from /proc before and after each batch. A warm-up batch per
router and shape comes first, then `--trials` trials, each one batch per router and shape,
so that drift on the machine spreads over every figure.

The shapes: completions and chat, streamed and whole, all of `--max-tokens` output tokens
and the same prompt; and the Responses route, streamed and whole, each kept in the store
(the route's default) and with `store: false`. Printed: router CPU s per 1,000 requests for
each router and shape, and a Responses request's CPU over a chat request's of the same
kind, on "now".

With `--baseline DIR` (another tree's `src`, e.g. `git archive c583fbc src | tar -x -C
/tmp/before`), that tree's router ("baseline") serves the completions and chat shapes too,
beside a second router of this tree ("now-again": the run's noise), and each of those
shapes gets now over baseline (now the mean of both routers of this tree). Target: within
3 %. The exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from bench_load import PROMPT
from bench_model import BenchOptions
from bench_procs import MODEL, cpu_seconds, raise_open_files_limit
from bench_targets import Bench, add_router, fleet, start_narwhal
from router_bench import sim_settings
from tenant_cpu import start_baseline
from tenant_figures import ratio

BASELINE = "baseline"
NOW = "now"
NOW_AGAIN = "now-again"
WITHIN = 0.03
# A streamed event carrying generated output: a non-empty `text` or `content`.
GENERATED = re.compile(rb'"(?:text|content)":\s*"(?!")')


@dataclass(frozen=True, slots=True)
class Shape:
    """One kind of request: its route, whether it streams, and (Responses) whether it is
    kept in the store."""

    name: str
    route: str
    stream: bool
    store: bool = True

    @property
    def responses(self) -> bool:
        return self.route == "/v1/responses"

    def body(self, max_tokens: int) -> bytes:
        """The request's body: the same prompt and output length on every route."""
        body: dict[str, Any] = {"model": MODEL, "stream": self.stream}
        if self.route == "/v1/completions":
            body |= {"prompt": PROMPT, "max_tokens": max_tokens}
        elif self.route == "/v1/chat/completions":
            body |= {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens}
        else:
            body |= {"input": PROMPT, "max_output_tokens": max_tokens}
            if not self.store:
                body["store"] = False
        return orjson.dumps(body)


SHAPES = (
    Shape("completions-stream", "/v1/completions", stream=True),
    Shape("completions-whole", "/v1/completions", stream=False),
    Shape("chat-stream", "/v1/chat/completions", stream=True),
    Shape("chat-whole", "/v1/chat/completions", stream=False),
    Shape("responses-stream", "/v1/responses", stream=True),
    Shape("responses-whole", "/v1/responses", stream=False),
    Shape("responses-stream-unstored", "/v1/responses", stream=True, store=False),
    Shape("responses-whole-unstored", "/v1/responses", stream=False, store=False),
)
# Each Responses shape against the chat shape of the same kind.
AGAINST_CHAT = {
    "responses-stream": "chat-stream",
    "responses-whole": "chat-whole",
    "responses-stream-unstored": "chat-stream",
    "responses-whole-unstored": "chat-whole",
}


@dataclass(slots=True)
class Tally:
    """One router's batches of one shape, summed."""

    ok: int = 0
    errors: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    router_cpu_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(message[:300])

    def add(self, other: Tally) -> None:
        self.ok += other.ok
        self.errors += other.errors
        self.tokens += other.tokens
        self.wall_s += other.wall_s
        self.router_cpu_s += other.router_cpu_s
        self.error_samples += other.error_samples[: 5 - len(self.error_samples)]

    @property
    def cpu_s_per_1k_requests(self) -> float | None:
        return self.router_cpu_s / self.ok * 1000 if self.ok else None

    @property
    def requests_per_s(self) -> float | None:
        return self.ok / self.wall_s if self.wall_s else None


# --- Checking answers -----------------------------------------------------------------------


def _events(raw: bytes) -> list[bytes]:
    return [event for event in raw.split(b"\n\n") if event.strip()]


def answered_tokens(shape: Shape, raw: bytes) -> int:
    """The output tokens an answer of `shape` reports; raises ValueError when it is not a
    whole answer (a stream that did not end as it should)."""
    if not shape.stream:
        usage = orjson.loads(raw).get("usage") or {}
        tokens = usage.get("output_tokens" if shape.responses else "completion_tokens")
    elif shape.responses:
        # The last event is the response as it ended, with its usage.
        kind, _, data = _events(raw)[-1].partition(b"\n")
        if kind not in (b"event: response.completed", b"event: response.incomplete"):
            raise ValueError(f"the stream ended with {kind!r}")
        usage = orjson.loads(data.removeprefix(b"data: "))["response"].get("usage") or {}
        tokens = usage.get("output_tokens")
    else:
        events = _events(raw)
        if not events or events[-1] != b"data: [DONE]":
            raise ValueError("the stream did not end with [DONE]")
        # One event per token with its text (completions) or content (chat), not empty.
        tokens = sum(1 for event in events[:-1] if GENERATED.search(event))
    if not isinstance(tokens, int):
        raise ValueError(f"no output token count in {raw[-300:]!r}")
    return tokens


# --- Running batches ------------------------------------------------------------------------


async def run_batch(
    url: str, pid: int, shape: Shape, requests: int, concurrency: int, max_tokens: int
) -> Tally:
    """`requests` requests of `shape` from `concurrency` clients, and the router's CPU
    (process `pid`) over them."""
    tally = Tally()
    body = shape.body(max_tokens)
    headers = {"Content-Type": "application/json"}
    pending = iter(range(requests))

    async def client(http: aiohttp.ClientSession) -> None:
        for _ in pending:
            try:
                async with http.post(url + shape.route, data=body, headers=headers) as answer:
                    raw = await answer.read()
                    if answer.status != 200:
                        raise ValueError(f"HTTP {answer.status}: {raw[:200]!r}")
                tokens = answered_tokens(shape, raw)
                if tokens != max_tokens:
                    raise ValueError(f"{tokens} output tokens, {max_tokens} asked")
            except (aiohttp.ClientError, ValueError, KeyError, TimeoutError) as exc:
                tally.fail(f"{shape.name}: {type(exc).__name__}: {exc}")
            else:
                tally.ok += 1
                tally.tokens += tokens

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        cpu_before, started = cpu_seconds(pid), time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(client(http))
        tally.wall_s = time.perf_counter() - started
        tally.router_cpu_s = cpu_seconds(pid) - cpu_before
    return tally


@dataclass(frozen=True, slots=True)
class Plan:
    requests: int = 2000
    trials: int = 5
    concurrency: int = 64
    max_tokens: int = 64
    shapes: tuple[Shape, ...] = SHAPES
    baseline: Path | None = None


@dataclass(slots=True)
class Report:
    """Each router's tallies by shape, in the order run."""

    plan: Plan
    tallies: dict[str, dict[str, Tally]]

    def cpu(self, router: str, shape: str) -> float | None:
        tally = self.tallies.get(router, {}).get(shape)
        return None if tally is None else tally.cpu_s_per_1k_requests

    @property
    def errors(self) -> int:
        return sum(t.errors for shapes in self.tallies.values() for t in shapes.values())


def serves(router: str, shape: Shape) -> bool:
    """Every router serves the other routes; only "now" the Responses route (the baseline
    has none, and a second router of this tree would show only noise there)."""
    return router == NOW or not shape.responses


async def start_routers(bench: Bench, plan: Plan) -> list[str]:
    """The routers started: "now", and with a baseline "now-again" and "baseline"."""
    names = [NOW] + ([NOW_AGAIN] if plan.baseline is not None else [])
    for name in names:
        store = {"responses": {"path": str(bench.workdir / f"{name}-responses.sqlite3")}}
        starting = start_narwhal(
            bench.producer_url, bench.consumer_url, bench.workdir, name=name, settings=store
        )
        await add_router(bench, name, starting)
    if plan.baseline is not None:
        await start_baseline(bench, plan.baseline)
        names.append(BASELINE)
    return names


async def measure(plan: Plan, workdir: Path, say: Any = print) -> Report:
    """Start the fleet and the routers, warm each up, run the interleaved trials."""
    raise_open_files_limit()
    settings = sim_settings(BenchOptions(), plan.concurrency, plan.max_tokens)
    async with fleet(settings, 0, 0, workdir) as bench:
        names = await start_routers(bench, plan)
        urls = {target.name: target.url for target in bench.targets}
        runs = [(name, shape) for name in names for shape in plan.shapes if serves(name, shape)]
        tallies: dict[str, dict[str, Tally]] = {name: {} for name in names}

        async def batch(name: str, shape: Shape, requests: int) -> Tally:
            url = urls[name]
            assert url is not None
            return await run_batch(
                url, bench.pids[name], shape, requests, plan.concurrency, plan.max_tokens
            )

        for name, shape in runs:
            warm = await batch(name, shape, min(plan.requests, 2 * plan.concurrency))
            if warm.errors:
                say(f"warm-up {name} {shape.name}: {warm.errors} errors: {warm.error_samples}")
        for trial in range(1, plan.trials + 1):
            for name, shape in runs:
                tally = await batch(name, shape, plan.requests)
                tallies[name].setdefault(shape.name, Tally()).add(tally)
                cpu = tally.cpu_s_per_1k_requests
                say(
                    f"trial {trial} {name} {shape.name}: {tally.ok} ok, {tally.errors} errors, "
                    f"router CPU {'n/a' if cpu is None else f'{cpu:.3f}'} s / 1k requests"
                )
        return Report(plan, tallies)


# --- Figures --------------------------------------------------------------------------------


def _shown(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def mean_now(report: Report, shape: str) -> float | None:
    """This tree's CPU per request on a shape: the mean of its routers that served it."""
    values = [v for v in (report.cpu(NOW, shape), report.cpu(NOW_AGAIN, shape)) if v is not None]
    return sum(values) / len(values) if values else None


def against_baseline(report: Report) -> dict[str, dict[str, float | None]]:
    """For each shape the baseline served: now (the mean), baseline, their ratio, and the
    noise (now-again over now)."""
    figures: dict[str, dict[str, float | None]] = {}
    for shape in report.tallies.get(BASELINE, {}):
        now = mean_now(report, shape)
        before = report.cpu(BASELINE, shape)
        figures[shape] = {
            "now": now,
            "baseline": before,
            "ratio": ratio(now, before),
            "noise": ratio(report.cpu(NOW_AGAIN, shape), report.cpu(NOW, shape)),
        }
    return figures


def against_chat(report: Report) -> dict[str, dict[str, float | None]]:
    """Each Responses shape's CPU per request over its chat shape's, on "now"."""
    figures: dict[str, dict[str, float | None]] = {}
    for shape, chat in AGAINST_CHAT.items():
        mine, theirs = report.cpu(NOW, shape), report.cpu(NOW, chat)
        if mine is not None and theirs is not None:
            figures[shape] = {"responses": mine, "chat": theirs, "ratio": ratio(mine, theirs)}
    return figures


def format_report(report: Report) -> str:
    plan = report.plan
    lines = [
        f"{plan.trials} trials x {plan.requests} requests per router and shape, "
        f"{plan.concurrency} clients, {plan.max_tokens} output tokens",
        "",
        f"{'router':<11}{'shape':<27}{'ok':>8}{'errors':>8}{'req/s':>9}{'CPU s / 1k req':>16}",
    ]
    for name, shapes in report.tallies.items():
        for shape, tally in shapes.items():
            lines.append(
                f"{name:<11}{shape:<27}{tally.ok:>8}{tally.errors:>8}"
                f"{_shown(tally.requests_per_s, 1):>9}{_shown(tally.cpu_s_per_1k_requests):>16}"
            )
            lines += [f"  error: {sample}" for sample in tally.error_samples]
    chat = against_chat(report)
    if chat:
        lines += ["", "Responses over chat, router CPU per request (now):"]
        for shape, f in chat.items():
            lines.append(
                f"  {shape:<27}{_shown(f['responses'])} / {_shown(f['chat'])} = "
                f"{_shown(f['ratio'])}"
            )
    before = against_baseline(report)
    if before:
        lines += ["", f"Now over baseline, router CPU per request (target: within {WITHIN:.0%}):"]
        for shape, f in before.items():
            r = f["ratio"]
            met = "n/a" if r is None else ("yes" if abs(r - 1) <= WITHIN else "NO")
            lines.append(
                f"  {shape:<27}{_shown(f['now'])} / {_shown(f['baseline'])} = {_shown(r)}"
                f"  within: {met}  (noise, now-again / now: {_shown(f['noise'])})"
            )
    return "\n".join(lines)


def report_json(report: Report) -> bytes:
    plan = asdict(report.plan)
    plan["shapes"] = [shape.name for shape in report.plan.shapes]
    figures = {
        "plan": plan,
        "routers": {
            name: {
                shape: {**asdict(t), "cpu_s_per_1k_requests": t.cpu_s_per_1k_requests}
                for shape, t in shapes.items()
            }
            for name, shapes in report.tallies.items()
        },
        "against_chat": against_chat(report),
        "against_baseline": against_baseline(report),
    }
    return orjson.dumps(figures, option=orjson.OPT_INDENT_2, default=str)


# --- Command line ---------------------------------------------------------------------------


def chosen_shapes(names: str | None) -> tuple[Shape, ...]:
    """The shapes `--shapes` names, in their order in `SHAPES`; raises ValueError for others."""
    if names is None:
        return SHAPES
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    unknown = wanted - {shape.name for shape in SHAPES}
    if unknown or not wanted:
        known = ", ".join(shape.name for shape in SHAPES)
        raise ValueError(f"--shapes: shapes are {known}; got {names!r}")
    return tuple(shape for shape in SHAPES if shape.name in wanted)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    d = Plan()
    add("--requests", type=int, default=d.requests, help="requests per batch")
    add("--trials", type=int, default=d.trials, help="interleaved trials")
    add("--concurrency", type=int, default=d.concurrency, help="concurrent clients")
    add("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request")
    add("--shapes", help="comma-separated shapes (default all)")
    add("--baseline", type=Path, help="also the router of this source tree's src/")
    add("--json", type=Path, help="write every figure to this JSON file")
    add("--workdir", type=Path, help="keep configs and logs here (default: a temp dir)")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    return Plan(
        requests=args.requests,
        trials=args.trials,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        shapes=chosen_shapes(args.shapes),
        baseline=args.baseline.resolve() if args.baseline else None,
    )


async def _main(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        workdir = args.workdir
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="responses-")))
        workdir.mkdir(parents=True, exist_ok=True)
        report = await measure(plan, workdir)
    print()
    print(format_report(report))
    if args.json:
        args.json.write_bytes(report_json(report))
        print(f"figures written to {args.json}")
    return 1 if report.errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run from the command line; the exit status is 1 when any request failed."""
    return uvloop.run(_main(parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

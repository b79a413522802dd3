"""The "no tenants configured" experiment: the bench's router CPU per request, interleaved.

On the bench's own fleet (engines answering at once, unlimited seats) and load, in one
interleaved run: no tenants; one default tenant with no limits; no tenants again (the
run's noise); and, given another source tree, its router (the code before a change).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_model import BenchOptions
from bench_procs import Proc, free_port
from bench_targets import (
    Bench,
    add_router,
    fleet,
    narwhal_config,
    start_loads,
    start_narwhal,
    wait_healthy,
)
from router_bench import _trials, sim_settings
from tenant_figures import Verdict, near, ratio, verdict


def say(text: str) -> None:
    print(text, flush=True)


async def start_baseline(bench: Bench, source: Path) -> str:
    """The router of another source tree (`source`: its absolute `src`, e.g. from `git
    archive` of the commit before a change) with the plain configuration, as the target
    "baseline": run with this interpreter, its package first on the path."""
    port = free_port()
    config = bench.workdir / "baseline.toml"
    config.write_text(narwhal_config(bench.producer_url, bench.consumer_url, port))
    argv = [
        *("env", f"PYTHONPATH={source}", sys.executable, "-m", "narwhal", "serve"),
        *("--config", str(config), "--skip-preflight"),
    ]
    url = f"http://127.0.0.1:{port}"

    async def starting() -> tuple[Proc, str]:
        proc = await Proc.start("baseline", argv, bench.workdir)
        await wait_healthy(proc, url)
        return proc, url

    return await add_router(bench, "baseline", starting())


async def no_tenants_cpu(
    workdir: Path, requests: int, trials: int, baseline: Path | None
) -> tuple[list[Verdict], dict[str, Any]]:
    """The bench's CPU per request, interleaved in one run on the bench's own fleet
    (engines answering at once): no tenants; one default tenant with no limits; no tenants
    again (the run's noise); and with `baseline` (a source tree's absolute `src`), its router."""
    options = BenchOptions(
        shape="stream",
        max_tokens=64,
        concurrency=64,
        requests=requests,
        trials=trials,
        direct=False,
        quiet=True,
    )
    everyone = {"tenants_policy": {"default": "everyone"}}
    async with fleet(sim_settings(options, 64, 64), 0, 0, workdir) as bench:
        for name, settings, tenants in (
            ("plain", None, ()),
            ("tenant", everyone, ({"name": "everyone"},)),
            ("plain-again", None, ()),
        ):
            starting = start_narwhal(
                bench.producer_url,
                bench.consumer_url,
                workdir,
                name=name,
                settings=settings,
                tenants=tenants,
            )
            await add_router(bench, name, starting)
        if baseline is not None:
            await start_baseline(bench, baseline)
        await start_loads(bench, 1)
        report = await _trials(bench, options, lambda text: None)
    rows = {s.name: s for s in report.summaries}
    for s in report.summaries:
        say(
            f"cpu: {s.name}: {s.requests} answered, {s.errors} errors, {s.requests_per_s:.1f} "
            f"requests/s, router CPU {s.router_cpu_s_per_1k_requests:.3f} s per 1,000 requests"
        )

    def cpu(name: str) -> float | None:
        return rows[name].router_cpu_s_per_1k_requests

    cost = ratio(cpu("tenant"), cpu("plain"))
    noise = ratio(cpu("plain-again"), cpu("plain"))
    errors = sum(s.errors for s in report.summaries)
    verdicts = [
        verdict(
            "cpu",
            "router CPU / request: default tenant / none",
            cost,
            "0.97 .. 1.03",
            near(cost, 0.03),
        ),
        verdict(
            "cpu",
            "(noise: no tenants twice, again / first)",
            noise,
            "-",
            None if noise is None else True,
        ),
    ]
    if "baseline" in rows:
        # No tenants now against the code before: the mean of both plain routers.
        plain = [value for value in (cpu("plain"), cpu("plain-again")) if value is not None]
        now = sum(plain) / len(plain) if plain else None
        against = ratio(now, cpu("baseline"))
        verdicts.append(
            verdict(
                "cpu",
                "router CPU / request: no tenants / baseline",
                against,
                "0.97 .. 1.03",
                near(against, 0.03),
            )
        )
    verdicts.append(verdict("cpu", "requests failed (any router)", errors, "0", errors == 0))
    return verdicts, {s.name: asdict(s) for s in report.summaries}

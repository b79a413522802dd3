"""The feature matrix: what each optional feature of the router costs, in one run.

`narwhal bench --matrix` runs, beside the plain router (its defaults) and the peers, one
more Narwhal per feature in `FEATURES`: a feature that is off by default turned on, one
that is on by default turned off. Each feature's cost is then the difference in router CPU
per request against the plain router, as a share of the router without the feature.

A feature that lands later joins the matrix as one more row of `FEATURES`: its name, what
it does, whether it is on by default, and the configuration that flips it. A route is priced
the same way: its row's router is sent the same requests on that route, so its cost is what
a request there costs over one on the plain router's routes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench_load import Target
from bench_model import BenchReport, Summary
from bench_report import number
from bench_targets import Bench, start_narwhal

PLAIN = "narwhal"


@dataclass(frozen=True, slots=True)
class Feature:
    """One optional feature, and the configuration that flips it from its default.

    Strings in `settings` may name `{workdir}` (the run's directory); `traced` features
    export their spans to the bench's OTLP sink.
    """

    name: str
    about: str
    default_on: bool
    settings: Mapping[str, Mapping[str, object]]
    traced: bool = False
    # `[[tenants]]` entries the flipped router has.
    tenants: tuple[Mapping[str, object], ...] = ()
    # The row's requests go to the Responses route (`bench_load.Call.as_responses`).
    responses: bool = False

    @property
    def target(self) -> str:
        """The matrix row's name: the plain router with this feature flipped."""
        return f"{PLAIN} {'-' if self.default_on else '+'}{self.name}"

    def resolved(self, workdir: Path) -> dict[str, dict[str, object]]:
        return {
            table: {
                key: value.format(workdir=workdir) if isinstance(value, str) else value
                for key, value in keys.items()
            }
            for table, keys in self.settings.items()
        }


FEATURES: tuple[Feature, ...] = (
    Feature(
        "tracing",
        "every request traced (sample_ratio 1), spans sent over OTLP/HTTP to a sink",
        False,
        {"tracing": {"sample_ratio": 1.0}},
        traced=True,
    ),
    Feature(
        "tracing-0.1",
        "tracing with one request in ten sampled",
        False,
        {"tracing": {"sample_ratio": 0.1}},
        traced=True,
    ),
    Feature(
        "journal",
        "one JSON line per request appended to a file",
        False,
        {"journal": {"path": "{workdir}/journal.jsonl"}},
    ),
    Feature(
        "controller",
        "the role controller (advisory), fed by every finished request",
        False,
        {"controller": {"enabled": True, "advisory": True}},
    ),
    Feature(
        "continuation",
        "stream continuation: token ids asked of the consumer and tracked per stream",
        False,
        {"continuation": {"enabled": True}},
    ),
    Feature(
        "tenants",
        "every request of a tenant with both per-minute limits and a max_concurrent, none "
        "reached: its admission, headers, settlement and per-tenant metrics",
        False,
        {"tenants_policy": {"default": "bench"}},
        tenants=(
            {
                "name": "bench",
                "requests_per_minute": 1e9,
                "tokens_per_minute": 1e12,
                "max_concurrent": 1_000_000,
            },
        ),
    ),
    Feature(
        "responses",
        "the same requests on /v1/responses, each response stored (SQLite, in the run's "
        "directory): the route's cost over completions and chat",
        False,
        {"responses": {"path": "{workdir}/responses.sqlite3"}},
        responses=True,
    ),
    Feature(
        "engine-load",
        "each engine's /metrics read every second (engine.metrics_interval_s)",
        True,
        {"engine": {"metrics_interval_s": 0}},
    ),
    Feature(
        "releases",
        "abandoned handoffs released through a consumer (engine.release_abandoned)",
        True,
        {"engine": {"release_abandoned": False}},
    ),
    Feature(
        "prefix-placement",
        "cache-aware placement: each prompt's chunk keys hashed, looked up and recorded",
        True,
        {"placement": {"policy": "p2c"}},
    ),
    Feature(
        "silence-watchdog",
        "silence between tokens ends a stream (engine.decode_read_timeout_s)",
        True,
        {"engine": {"decode_read_timeout_s": 0}},
    ),
)


def feature_cost(feature: Feature, plain: Summary, flipped: Summary) -> float | None:
    """The feature's router CPU per request, as a share of the router's without it."""
    on, off = (plain, flipped) if feature.default_on else (flipped, plain)
    if on.router_cpu_s_per_1k_requests is None or not off.router_cpu_s_per_1k_requests:
        return None
    return on.router_cpu_s_per_1k_requests / off.router_cpu_s_per_1k_requests - 1


def format_matrix(report: BenchReport, features: tuple[Feature, ...] = FEATURES) -> str:
    """One line per router: throughput, CPU per request and per token, and for each
    feature row what the feature costs."""
    names = {s.name for s in report.summaries}
    if PLAIN not in names:
        return ""
    plain = report.summary(PLAIN)
    rows = [
        f"{'target':<28}{'default':>8}{'req/s':>9}{'CPU s/1k req':>14}{'/1k tok':>10}"
        f"{'feature costs':>15}",
        _row(plain.name, "", plain, "(plain)"),
    ]
    for feature in features:
        if feature.target in names:
            flipped = report.summary(feature.target)
            cost = feature_cost(feature, plain, flipped)
            shown = "n/a" if cost is None else f"{cost * 100:+.1f} %"
            rows.append(_row(feature.target, "on" if feature.default_on else "off", flipped, shown))
    rows += [_row(s.name, "", s, "") for s in report.summaries if s.name in _PEERS]
    about = [f"  {f.name}: {f.about}" for f in features if f.target in names]
    head = "feature matrix: router CPU per request, each feature's cost = with it / without it - 1"
    return "\n".join([head, *rows, "", *about])


_PEERS = ("vllm-router", "fastapi-proxy")


def _row(name: str, default: str, s: Summary, cost: str) -> str:
    return (
        f"{name:<28}{default:>8}{s.requests_per_s:>9.1f}"
        f"{number(s.router_cpu_s_per_1k_requests):>14}"
        f"{number(s.router_cpu_s_per_1k_tokens, 5):>10}{cost:>15}"
    )


async def add_matrix(bench: Bench, traces_to: str | None, say: Callable[[str], None]) -> None:
    """Start one Narwhal per feature, each a target named by its matrix row."""
    for feature in FEATURES:
        settings = feature.resolved(bench.workdir)
        if feature.traced:
            assert traces_to is not None, "traced features need the OTLP sink"
            settings["tracing"] = {"enabled": True, "endpoint": traces_to, **settings["tracing"]}
        slug = f"narwhal-{'without' if feature.default_on else 'with'}-{feature.name}"
        starting = start_narwhal(
            bench.producer_url,
            bench.consumer_url,
            bench.workdir,
            name=slug,
            settings=settings,
            tenants=feature.tenants,
        )
        proc, url = await starting
        bench.procs.append(proc)
        bench.targets.append(Target(feature.target, url=url, responses=feature.responses))
        bench.pids[feature.target] = proc.pid
        say(f"{feature.target}: {url} (pid {proc.pid})")

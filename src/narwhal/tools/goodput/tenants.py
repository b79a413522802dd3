"""Multi-tenant load: one load shape per tenant, and each tenant's figures.

Pure. `narwhal bench` and `narwhal goodput` take one `--tenant` flag per tenant:

    --tenant NAME:KEY=VALUE,KEY=VALUE,...

whose keys are, first, the tenant's own `[[tenants]]` settings, written into the router's
configuration as they are given (`weight`, `priority`, `max_concurrent`, `max_queued`,
`requests_per_minute`, `tokens_per_minute`, `ttft_objective_s`), and then its load:

| key             | meaning                                                              |
|-----------------|----------------------------------------------------------------------|
| `key`           | the tenant's API key, sent as `Authorization: Bearer` (default `sk-NAME`) |
| `rate`          | open loop: requests per second, arriving whatever the answers        |
| `concurrency`   | closed loop: clients each sending its next request after an answer   |
| `arrivals`      | open loop's spacing: `poisson` (default) or `fixed`                  |
| `shape`         | the command's own shape names (bench: `short`, `long`; goodput: a trace shape) |
| `prompt_tokens` | prompt length in token ids (exact: the router counts ids, not bytes) |
| `max_tokens`    | output tokens asked for                                              |
| `retry_after`   | `true`: a refused request (429/503) is sent again after its `Retry-After` |
| `start_s`, `stop_s` | when the tenant's load begins and ends, in seconds of the run    |

Exactly one of `rate` and `concurrency`. For example, a batch tenant flooding beside an
interactive one:

    --tenant batch:priority=1,rate=400 --tenant chat:priority=0,rate=5,max_tokens=32

Each request the load sends ends as a `Record`; `tenant_stats` turns a tenant's records
into its figures (requests, answered, refused by status, goodput, TTFT p50/p99, tokens
served, and how its returns after a `Retry-After` fared).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from narwhal.tools.goodput.score import Outcome, Slo, percentile

Arrivals = Literal["poisson", "fixed"]

# The `[[tenants]]` keys a spec may set, with the type each is read as.
TENANT_KEYS: Final[dict[str, type]] = {
    "weight": float,
    "priority": int,
    "max_concurrent": int,
    "max_queued": int,
    "requests_per_minute": float,
    "tokens_per_minute": float,
    "ttft_objective_s": float,
}
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_TRUE: Final = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
# Statuses a refusal comes with: a tenant's own limit, and overload or shedding.
REFUSALS: Final = (429, 503)


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant: its router settings (`settings`, `[[tenants]]` keys) and its load."""

    name: str
    key: str = ""
    settings: tuple[tuple[str, float | int], ...] = ()
    rate: float | None = None
    concurrency: int | None = None
    arrivals: Arrivals = "poisson"
    shape: str | None = None
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    retry_after: bool = False
    start_s: float = 0.0
    stop_s: float | None = None

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", f"sk-{self.name}")

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    def setting(self, name: str) -> float | int | None:
        """One of the tenant's `[[tenants]]` settings, None when the spec leaves it out."""
        return dict(self.settings).get(name)

    def tenant_table(self) -> dict[str, Any]:
        """The tenant's `[[tenants]]` entry in the router's configuration."""
        return {"name": self.name, "api_keys": [self.key], **dict(self.settings)}

    def to_json(self) -> dict[str, Any]:
        """For a load process: the fields, settings as a list of pairs."""
        return {
            "name": self.name,
            "key": self.key,
            "settings": [list(pair) for pair in self.settings],
            "rate": self.rate,
            "concurrency": self.concurrency,
            "arrivals": self.arrivals,
            "shape": self.shape,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "retry_after": self.retry_after,
            "start_s": self.start_s,
            "stop_s": self.stop_s,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> TenantLoad:
        fields = dict(value)
        fields["settings"] = tuple((str(k), v) for k, v in fields.get("settings", ()))
        return cls(**fields)


def parse_tenant(text: str, *, load_required: bool = True) -> TenantLoad:
    """A `--tenant NAME:KEY=VALUE,...` flag; raises ValueError saying what is wrong.
    Without `load_required` a spec may give neither `rate` nor `concurrency` (its load
    comes from elsewhere, e.g. a trace file naming its tenants)."""
    name, sep, rest = text.partition(":")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"--tenant {text!r}: expected NAME:KEY=VALUE,... with a NAME of letters, digits "
            "and _ . : - (at most 64)"
        )
    settings: dict[str, float | int] = {}
    load: dict[str, Any] = {}
    for part in rest.split(",") if sep and rest else ():
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"--tenant {name}: expected KEY=VALUE, got {part!r}")
        if key in settings or key in load:
            raise ValueError(f"--tenant {name}: {key} given twice")
        try:
            if key in TENANT_KEYS:
                settings[key] = _number(value, TENANT_KEYS[key])
            else:
                load[key] = _load_value(key, value)
        except ValueError as exc:
            raise ValueError(f"--tenant {name}: {key}: {exc}") from None
    tenant = TenantLoad(name=name, settings=tuple(settings.items()), **load)
    if tenant.rate is not None and tenant.concurrency is not None:
        raise ValueError(f"--tenant {name}: give one of rate=R and concurrency=C, not both")
    if load_required and tenant.rate is None and tenant.concurrency is None:
        raise ValueError(f"--tenant {name}: give its load, rate=R or concurrency=C")
    if tenant.stop_s is not None and tenant.stop_s <= tenant.start_s:
        raise ValueError(f"--tenant {name}: stop_s must be after start_s")
    return tenant


def check_tenants(tenants: Sequence[TenantLoad]) -> None:
    """Names and keys each used once; raises ValueError naming the repeat."""
    for attribute in ("name", "key"):
        values = [getattr(tenant, attribute) for tenant in tenants]
        repeated = sorted({value for value in values if values.count(value) > 1})
        if repeated:
            raise ValueError(f"--tenant: the same {attribute} for two tenants: {repeated[0]}")


def _load_value(key: str, value: str) -> Any:
    if key in ("key", "shape"):
        return value
    if key == "rate":
        return _positive(float(value))
    if key in ("concurrency", "prompt_tokens", "max_tokens"):
        return int(_positive(_number(value, int)))
    if key == "arrivals":
        if value not in ("poisson", "fixed"):
            raise ValueError(f"poisson or fixed, got {value!r}")
        return value
    if key == "retry_after":
        if value.lower() not in _TRUE:
            raise ValueError(f"true or false, got {value!r}")
        return _TRUE[value.lower()]
    if key in ("start_s", "stop_s"):
        seconds = float(value)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"must be at least 0, got {value}")
        return seconds
    known = ", ".join([*TENANT_KEYS, "key", "rate", "concurrency", "arrivals", "shape"])
    raise ValueError(f"unknown key (known: {known}, prompt_tokens, max_tokens, retry_after, ...)")


def _number(value: str, kind: type) -> float | int:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"must be a finite number, got {value}")
    if kind is int:
        if number != int(number):
            raise ValueError(f"must be an integer, got {value}")
        return int(number)
    return number


def _positive(number: float) -> float:
    if not number > 0:
        raise ValueError(f"must be more than 0, got {number:g}")
    return number


def with_defaults(
    tenant: TenantLoad, *, prompt_tokens: int, max_tokens: int, shape: str | None = None
) -> TenantLoad:
    """The tenant with the command's defaults where its spec left a length or shape out."""
    return replace(
        tenant,
        prompt_tokens=tenant.prompt_tokens or prompt_tokens,
        max_tokens=tenant.max_tokens or max_tokens,
        shape=tenant.shape or shape,
    )


def arrival_times(tenant: TenantLoad, duration_s: float, rng: random.Random) -> list[float]:
    """An open-loop tenant's send times, seconds from the run's start, in its window."""
    if tenant.rate is None:
        return []
    start, stop = tenant.start_s, min(duration_s, tenant.stop_s or duration_s)
    times: list[float] = []
    if tenant.arrivals == "fixed":
        gap = 1 / tenant.rate
        t = start
        while t < stop:
            times.append(t)
            t = start + len(times) * gap  # no drift from adding up rounded gaps
        return times
    t = start + rng.expovariate(tenant.rate)
    while t < stop:
        times.append(t)
        t += rng.expovariate(tenant.rate)
    return times


@dataclass(frozen=True, slots=True)
class Record:
    """One request as its client saw it.

    `status` is the HTTP status (0: no answer at all); `ok` a 200 whose stream ended with
    every token asked for. Token counts are the engine's usage when the stream carried it,
    else what was sent and counted. `returned`: this request is a refused one sent again
    after its `Retry-After`. Times are seconds from the run's start.
    """

    tenant: str
    sent_s: float
    status: int
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retry_after_s: float | None = None
    returned: bool = False
    ended_s: float = 0.0

    @property
    def refused(self) -> bool:
        return self.status in REFUSALS

    @property
    def admitted(self) -> bool:
        """Let through the router's admission: anything but a refusal (a 200 that
        failed later was still admitted)."""
        return self.status != 0 and not self.refused

    def to_row(self) -> list[Any]:
        return [
            self.tenant,
            round(self.sent_s, 6),
            self.status,
            self.ok,
            self.ttft_s,
            self.tpot_s,
            self.prompt_tokens,
            self.completion_tokens,
            self.retry_after_s,
            self.returned,
            round(self.ended_s, 6),
        ]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Record:
        return cls(*row)


def outcome_record(outcome: Outcome) -> Record:
    """A replayed trace request (`narwhal goodput`) as a record, its times in trace seconds."""
    return Record(
        tenant=outcome.tenant,
        sent_s=outcome.arrival_s,
        status=outcome.status,
        ok=outcome.completed,
        ttft_s=outcome.ttft_s,
        tpot_s=outcome.tpot_s,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
        retry_after_s=outcome.retry_after_s,
        returned=outcome.returned,
    )


@dataclass(frozen=True, slots=True)
class TenantStats:
    """A tenant's figures over a window of its records (by send time)."""

    tenant: str
    requests: int
    ok: int
    refused: dict[int, int]
    failed: int
    seconds: float
    good: int
    goodput_rps: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tokens_served: int
    returns: int
    admitted_on_return: int

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())


def tenant_stats(
    tenant: str,
    records: Iterable[Record],
    *,
    window: tuple[float, float],
    slo: Slo | None = None,
    by_end: bool = False,
) -> TenantStats:
    """The tenant's figures over requests sent in `window` (start, end seconds), or with
    `by_end` over those that ended in it (what was served in a span of time).

    Good requests are answered ones within `slo` (every answered one without an SLO);
    goodput is good requests per second of the window; tokens served are prompt plus
    completion tokens of answered requests.
    """
    start, end = window
    mine = [
        r
        for r in records
        if r.tenant == tenant and start <= (r.ended_s if by_end else r.sent_s) < end
    ]
    answered = [r for r in mine if r.ok]
    refused: dict[int, int] = {}
    for record in mine:
        if record.refused:
            refused[record.status] = refused.get(record.status, 0) + 1
    good = [r for r in answered if slo is None or _within(r, slo)]
    ttfts = [r.ttft_s for r in answered if r.ttft_s is not None]
    seconds = max(end - start, 1e-9)
    returns = [r for r in mine if r.returned]
    return TenantStats(
        tenant=tenant,
        requests=len(mine),
        ok=len(answered),
        refused=refused,
        failed=len(mine) - len(answered) - sum(refused.values()),
        seconds=seconds,
        good=len(good),
        goodput_rps=len(good) / seconds,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        tokens_served=sum(r.prompt_tokens + r.completion_tokens for r in answered),
        returns=len(returns),
        admitted_on_return=sum(r.admitted for r in returns),
    )


def _within(record: Record, slo: Slo) -> bool:
    return (
        record.ttft_s is not None
        and record.ttft_s <= slo.ttft_s
        and (record.tpot_s is None or record.tpot_s <= slo.tpot_s)
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def format_stats(stats: Sequence[TenantStats]) -> str:
    """One row per tenant: requests, answered, refused by status, goodput, TTFT, tokens."""
    header = (
        f"{'tenant':<14}{'reqs':>7}{'ok':>7}{'429':>7}{'503':>7}{'failed':>7}"
        f"{'goodput/s':>10}{'TTFT p50':>10}{'p99 ms':>8}{'tokens':>11}{'returns ok':>12}"
    )
    lines = [header, "-" * len(header)]
    for s in stats:
        returns = f"{s.admitted_on_return}/{s.returns}" if s.returns else "-"
        lines.append(
            f"{s.tenant:<14}{s.requests:>7}{s.ok:>7}{s.refused.get(429, 0):>7}"
            f"{s.refused.get(503, 0):>7}{s.failed:>7}{s.goodput_rps:>10.2f}"
            f"{_ms(s.ttft_p50_s):>10}{_ms(s.ttft_p99_s):>8}{s.tokens_served:>11,}{returns:>12}"
        )
    return "\n".join(lines)


def stats_json(stats: TenantStats) -> dict[str, Any]:
    """A tenant's figures for a JSON report (statuses as string keys)."""
    return {
        "tenant": stats.tenant,
        "requests": stats.requests,
        "ok": stats.ok,
        "refused": {str(status): count for status, count in sorted(stats.refused.items())},
        "failed": stats.failed,
        "seconds": round(stats.seconds, 3),
        "good": stats.good,
        "goodput_rps": stats.goodput_rps,
        "ttft_p50_s": stats.ttft_p50_s,
        "ttft_p99_s": stats.ttft_p99_s,
        "tokens_served": stats.tokens_served,
        "returns": stats.returns,
        "admitted_on_return": stats.admitted_on_return,
    }

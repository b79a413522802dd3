"""`narwhal top`'s screen: a router's `/narwhal/state` as lines of text, for a terminal.

Pure: the same state, width and failure history always give the same lines, so the
terminal loop (`narwhal.commands.top_terminal`) only fetches, draws and reads keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

OUTCOMES = ("ok", "client_error", "timeout", "error", "client_closed")
# Engine table columns: heading, width (the last one takes what is left).
COLUMNS = (
    ("ENGINE", 12),
    ("MODEL", 16),
    ("ROLE", 8),
    ("STATE", 12),
    ("PREFILL", 9),
    ("DECODE", 9),
    ("RUN", 5),
    ("WAIT", 5),
    ("KV", 5),
    ("ABANDONED", 10),
    ("PINNED", 7),
)
# Tenant table columns (with `[[tenants]]`): heading, width.
TENANT_COLUMNS = (
    ("TENANT", 16),
    ("BAND", 6),
    ("WEIGHT", 8),
    ("IN FLIGHT", 11),
    ("QUEUED", 10),
    ("OK", 8),
    ("REFUSED", 9),
    ("LIMITS", 48),
)
# Failure counts per engine and cause, as `/narwhal/state` reports them.
Failures = Mapping[str, Mapping[str, int]]


def failures_of(state: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Each engine's failure counters, to remember and compare with a later frame."""
    return {engine["id"]: dict(engine.get("failures") or {}) for engine in state["engines"]}


def render(
    state: Mapping[str, Any] | None,
    width: int,
    *,
    url: str = "",
    clock: str = "",
    before: Failures | None = None,
    error: str | None = None,
    keys: bool = True,
) -> list[str]:
    """One frame: the router, its recent requests, its engines and their recent failures.

    `before` holds failure counts from the start of the window the frame calls recent;
    `error` says why the state could not be read (then `state` is the last one read, or
    None); `keys` adds the key help a live screen needs. Every line fits `width`.
    """
    lines = [_title(state, url, clock)]
    if error is not None:
        lines.append(
            f"router unreachable: {error}" + (" (showing its last state)" if state else "")
        )
    if state is not None:
        lines += _router(state)
        lines += _requests(state.get("recent"))
        lines += _models(state.get("models"))
        lines += _tenants(state)
        lines.append("")
        lines += _engines(state["engines"])
        lines += _recent_failures(state, before or {})
    if keys:
        lines += ["", "q quits"]
    return [_fit(line, width) for line in lines]


def status_word(state: Mapping[str, Any]) -> str:
    """Down only when no request can be placed; degraded when any engine is out or a phase
    is served by fallback or panic placement (as the fleet page says)."""
    if state.get("can_serve") is False:
        return "down"
    out = any(engine["state"] != "admitted" for engine in state["engines"])
    return "degraded" if state.get("degraded") or out else "serving"


def _title(state: Mapping[str, Any] | None, url: str, clock: str) -> str:
    parts = ["narwhal top", url]
    if state is not None:
        pools = list(state.get("models") or {})
        named = f"models {', '.join(pools)}" if len(pools) > 1 else f"model {state['model']}"
        parts += [named, status_word(state)]
    parts.append(clock)
    return " · ".join(part for part in parts if part)


def _router(state: Mapping[str, Any]) -> list[str]:
    budget = state["retry_budget"]
    return [
        f"in flight {state['in_flight']} · queued {state['queued']}/{state['queue_capacity']}"
        f" · engine legs {state['open_engine_legs']}"
        f" · retry credit {int(budget['credit'])}/{budget['size']}"
    ]


def _requests(recent: Mapping[str, Any] | None) -> list[str]:
    if recent is None:
        return []
    minutes = round(recent["window_s"] / 60)
    outcomes = recent.get("outcomes") or {}
    counted = [f"{name} {outcomes[name]}" for name in OUTCOMES if outcomes.get(name)]
    counted += [f"{name} {n}" for name, n in sorted(outcomes.items()) if name not in OUTCOMES]
    lines = [
        f"requests (last {minutes} min): {recent['requests']} · {recent['rate_per_s']:.2f}/s"
        + "".join(f" · {item}" for item in counted)
    ]
    handoffs = recent.get("handoffs") or {}
    if handoffs:
        lines.append(
            "handoffs: " + " · ".join(f"{kind} {n}" for kind, n in sorted(handoffs.items()))
        )
    lines.append(f"{'latency':<12}{'p50':>9}{'p90':>9}{'p99':>9}")
    for label, key in (("ttft", "ttft_s"), ("first byte", "first_byte_s")):
        values = recent.get(key) or {}
        lines.append(
            f"  {label:<10}"
            + "".join(f"{_seconds(values.get(q)):>9}" for q in ("p50", "p90", "p99"))
        )
    return lines


def _models(models: Mapping[str, Any] | None) -> list[str]:
    """One line per pool: admitted engines of each phase out of those serving it, and its
    adapters with how many engines hold each; nothing for one pool without adapters."""
    if not models or (len(models) == 1 and not next(iter(models.values()))["adapters"]):
        return []
    lines = [""]
    for model, pool in models.items():
        phases = " · ".join(
            f"{phase} {pool['admitted'][phase]}/{len(ids)}"
            for phase, ids in pool["engines"].items()
        )
        adapters = ", ".join(f"{name} ({len(ids)})" for name, ids in pool["adapters"].items())
        down = "" if pool["can_serve"] else " · down"
        lines.append(
            f"{model}: {phases} admitted{down}" + (f" · adapters {adapters}" if adapters else "")
        )
    return lines


def _tenants(state: Mapping[str, Any]) -> list[str]:
    """With tenants: one row per tenant, its band, weight, requests in flight and queued
    (out of its caps), recent outcomes and refusals, and its per-minute buckets' levels
    out of their limits; nothing without."""
    tenants: Mapping[str, Any] | None = state.get("tenants")
    if not tenants:
        return []
    recent = state.get("recent") or {}
    seen = recent.get("tenants") or {}
    minutes = round(recent.get("window_s", 300) / 60)
    default = next((name for name, tenant in tenants.items() if tenant.get("default")), None)
    lines = [
        "",
        f"tenants (ok and refused: last {minutes} min)"
        + (f" · default {default}" if default else ""),
    ]
    rows = [[heading for heading, _ in TENANT_COLUMNS]]
    for name, tenant in tenants.items():
        limits = tenant.get("limits") or {}
        share = tenant.get("share") or {}
        here = seen.get(name) or {}
        in_flight = tenant.get("in_flight")
        rows.append(
            [
                name,
                str(tenant.get("priority", 0)),
                f"{tenant.get('weight', 1):g}",
                _of(
                    tenant.get("in_flight_here", 0) if in_flight is None else in_flight,
                    share.get("max_concurrent") or limits.get("max_concurrent"),
                ),
                _of(tenant.get("queued", 0), limits.get("max_queued")),
                str((here.get("outcomes") or {}).get("ok", 0)),
                str(here.get("refused", 0)),
                _tenant_limits(tenant),
            ]
        )
    return lines + [_row(row, TENANT_COLUMNS) for row in rows]


def _tenant_limits(tenant: Mapping[str, Any]) -> str:
    """Its per-minute buckets as level/limit (this router's share), and its objective."""
    limits = tenant.get("limits") or {}
    share = tenant.get("share") or {}
    parts = []
    for label, key, level in (
        ("rpm", "requests_per_minute", "requests_level"),
        ("tpm", "tokens_per_minute", "tokens_level"),
    ):
        limit = share.get(key) or limits.get(key)
        if limit is not None:
            parts.append(f"{label} {_amount(tenant.get(level))}/{_amount(limit)}")
    objective = limits.get("ttft_objective_s")
    if objective is not None:
        parts.append(f"ttft {_seconds(objective)}")
    return " · ".join(parts) or "-"


def _of(count: int, cap: int | None) -> str:
    return str(count) if cap is None else f"{count}/{cap}"


def _amount(value: float | None) -> str:
    """A bucket level or limit: whole units, thousands as k."""
    if value is None:
        return "-"
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return str(int(value))


def _engines(engines: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = [[heading for heading, _ in COLUMNS]]
    for engine in engines:
        seats, role = engine["seats"], engine["role"]
        reported = engine.get("reported") or {}
        abandoned = engine.get("abandoned")
        usage = reported.get("kv_cache_usage")
        rows.append(
            [
                engine["id"],
                engine.get("model") or "-",
                role,
                engine["state"],
                _seats(seats["prefill"]) if role != "decode" else "-",
                _seats(seats["decode"]) if role != "prefill" else "-",
                _count(reported.get("running")),
                _count(reported.get("waiting")),
                "-" if usage is None else f"{round(100 * usage)}%",
                "-" if abandoned is None else str(abandoned["handoffs"]),
                "-" if abandoned is None else str(abandoned["pinned_blocks"]),
            ]
        )
    return [_row(row) for row in rows]


def _recent_failures(state: Mapping[str, Any], before: Failures) -> list[str]:
    """Failure counts that grew since `before`, per engine and cause, with totals; and the
    reason of any engine that is out."""
    lines = []
    for engine in state["engines"]:
        earlier = before.get(engine["id"], {})
        grown = [
            f"{cause} +{count - earlier.get(cause, 0)} ({count})"
            for cause, count in sorted((engine.get("failures") or {}).items())
            if count > earlier.get(cause, 0)
        ]
        if grown:
            lines.append(f"  {engine['id']}: " + ", ".join(grown))
        if engine["state"] == "ejected" and engine.get("ejection_reason"):
            lines.append(f"  {engine['id']} ejected: {engine['ejection_reason']}")
        elif engine["state"] == "quarantined":
            lines.append(
                f"  {engine['id']} quarantined for another {engine['quarantined_for_s']:.1f} s"
            )
    return ["", "recent failures", *(lines or ["  none"])]


def _row(cells: Sequence[str], columns: Sequence[tuple[str, int]] = COLUMNS) -> str:
    out = []
    for (_, width), cell in zip(columns, cells, strict=True):
        out.append(_fit(cell, width - 1).ljust(width))
    return "".join(out).rstrip()


def _seats(seats: Mapping[str, int]) -> str:
    limit = seats["limit"]
    return f"{seats['in_use']}/{limit if limit else '-'}"


def _count(value: object) -> str:
    """Engines report counts as floats (Prometheus samples); whole ones print whole."""
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{round(value * 1000)} ms" if value < 1 else f"{value:.2f} s"


def _fit(line: str, width: int) -> str:
    """Cut a line to `width` columns (an ellipsis marks the cut); control characters from
    the router's text (engine messages) are shown as spaces, never sent to the terminal."""
    line = "".join(" " if _control(ch) else ch for ch in line)
    if len(line) <= width:
        return line
    return line[: max(0, width - 1)] + "…" if width > 0 else ""


def _control(ch: str) -> bool:
    code = ord(ch)
    return code < 32 or 127 <= code < 160

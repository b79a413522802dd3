"""`[controller]` and `[slo]`: the role controller's switches and the latency objectives it
steers by.

Read with the rest of the configuration, so `narwhal config validate` names a bad key by its
path. The controller is off unless `[controller] enabled = true`; `advisory = true` has it
journal what it would do and change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from narwhal.config.table import Table


@dataclass(frozen=True, slots=True)
class SloConfig:
    """`[slo]`: time to first token, and time per output token after the first."""

    ttft_s: float = 1.0
    tpot_s: float = 0.05


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """`[controller]`: whether and how engines of role `both` move between phases."""

    enabled: bool = False
    # Decide and journal `role_advice`, but apply nothing.
    advisory: bool = False
    # How often a decision is taken, and the span of requests it looks back over.
    interval_s: float = 5.0
    window_s: float = 30.0
    # An engine keeps a role at least this long; no move at all this long after any move.
    dwell_s: float = 60.0
    cooldown_s: float = 30.0
    # Fewest engines acting in each phase (engines of a fixed role count too).
    min_prefill: int = 1
    min_decode: int = 1
    # Move only when the pressured phase's pressure (p90 latency over its SLO) is at least
    # `ratio` times the other's, and at least `min_pressure` itself.
    ratio: float = 1.5
    min_pressure: float = 0.8
    # Fewest finished requests in the window for a phase's p90 to count.
    min_samples: int = 20
    # Most engines one decision moves, when the pressured phase is overloaded with several
    # engines' worth of backlog (1: one engine per decision, always).
    max_moves: int = 2


def parse_slo(table: Table) -> SloConfig:
    d = SloConfig()
    slo = SloConfig(
        ttft_s=table.number("ttft_s", d.ttft_s), tpot_s=table.number("tpot_s", d.tpot_s)
    )
    table.close()
    return slo


def parse_controller(table: Table) -> ControllerConfig:
    """Read `[controller]`, recording each bad key's problem under its path."""
    d = ControllerConfig()
    config = ControllerConfig(
        enabled=_flag(table, "enabled", d.enabled),
        advisory=_flag(table, "advisory", d.advisory),
        interval_s=table.number("interval_s", d.interval_s),
        window_s=table.number("window_s", d.window_s),
        dwell_s=table.number("dwell_s", d.dwell_s, zero_ok=True),
        cooldown_s=table.number("cooldown_s", d.cooldown_s, zero_ok=True),
        min_prefill=table.integer("min_prefill", d.min_prefill, 1),
        min_decode=table.integer("min_decode", d.min_decode, 1),
        ratio=table.number("ratio", d.ratio),
        min_pressure=table.number("min_pressure", d.min_pressure, zero_ok=True),
        min_samples=table.integer("min_samples", d.min_samples, 1),
        max_moves=table.integer("max_moves", d.max_moves, 1),
    )
    if table.has("ratio") and config.ratio < 1.0:
        table.fail("ratio", f"must be at least 1 (a band around balance), got {config.ratio:g}")
    table.close()
    return config


def _flag(table: Table, key: str, default: bool) -> bool:
    value = table.take(key, required=False)
    if isinstance(value, bool):
        return value
    if table.has(key):
        table.fail(key, f"must be true or false, got {value!r}")
    return default


def controller_summary(controller: ControllerConfig, slo: SloConfig) -> str:
    """One line for `narwhal config validate`."""
    if not controller.enabled:
        return "off"
    mode = "advisory (decides, changes nothing)" if controller.advisory else "on"
    return (
        f"{mode}: every {controller.interval_s:g} s over {controller.window_s:g} s, dwell "
        f"{controller.dwell_s:g} s, cooldown {controller.cooldown_s:g} s, floors "
        f"{controller.min_prefill} prefill / {controller.min_decode} decode; SLO TTFT "
        f"{slo.ttft_s:g} s, TPOT {slo.tpot_s:g} s"
    )

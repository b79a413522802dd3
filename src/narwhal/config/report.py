"""`narwhal config validate`: a fleet file's problems, or what it would set up.

Apart from the reader so the report can grow with every section without crowding the rules
that check them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from narwhal.config.controller import controller_summary
from narwhal.config.discovery import discovery_summary
from narwhal.config.engine_spec import Role
from narwhal.config.root import Config, ConfigError, NonstreamDecode, load_config
from narwhal.config.table import show
from narwhal.config.tracing import TracingConfig


def validate_command(path: Path) -> int:
    """`narwhal config validate FILE`: the start-up report, without serving; the exit code."""
    try:
        config = load_config(path)
    except ConfigError as error:
        print(error.report(), file=sys.stderr)
        return 1
    print(summary(config, str(path)))
    return 0


def summary(config: Config, source: str) -> str:
    """What a valid file sets up, as `narwhal config validate` and `narwhal serve` print it."""
    engine, serving, recovery = config.engine, config.serving, config.recovery
    roles = ", ".join(
        f"{sum(spec.role is role for spec in config.engines)} {role}" for role in Role
    )

    def seconds(path: str, value: float) -> str:
        shown = f"{value:g} s" if value else "off"
        return shown + (" (derived)" if path in config.derived else "")

    contract = config.engine_contract
    pinned = (
        ", ".join(f"{key} = {show(value)}" for key, value in contract.pinned().items())
        if contract
        else "none"
    )
    lines = [
        f"{source}: OK",
        f"  model: {config.model}",
        f"  engines: {len(config.engines)} ({roles})",
        "  timeouts: first token "
        + seconds("engine.first_token_timeout_s", engine.first_token_timeout_s)
        + ", decode read "
        + seconds("engine.decode_read_timeout_s", engine.decode_read_timeout_s)
        + ", prefill "
        + seconds("engine.prefill_timeout_s", engine.prefill_timeout_s)
        + ", queue "
        + seconds("serving.queue_timeout_s", serving.queue_timeout_s)
        + f", request {serving.request_timeout_s:g} s",
        *whole_summary(config),
        f"  handoff bound: {config.handoff_bound_s:g} s "
        f"(kv lease {engine.kv_lease_s:g} s less a sixth)",
        f"  breaker: eject after {recovery.eject_after} failures, at most "
        f"{recovery.max_ejected_fraction:g} of a phase ejected; readmission every "
        f"{recovery.readmit_interval_s:g} s, "
        + seconds("recovery.urgent_readmit_interval_s", recovery.urgent_readmit_interval_s)
        + " while a phase has no admitted engine",
        f"  engine contract: {pinned}",
        f"  tracing: {tracing_summary(config.tracing)}",
    ]
    if config.discovery.enabled:
        lines.append(f"  discovery: {discovery_summary(config.discovery)}")
    if config.controller.enabled:
        lines.append(f"  role controller: {controller_summary(config.controller, config.slo)}")
    if config.server.workers != 1 or config.server.replicas != 1:
        lines.append(
            f"  workers: {config.server.workers} per router, {config.server.replicas} router "
            "replicas sharing every seat limit"
        )
    if config.derived:
        lines.append(
            "  (derived): unset, so clamped from the default to fit the key it must not exceed"
        )
    return "\n".join(lines)


def whole_summary(config: Config) -> list[str]:
    """Non-streaming decodes asked for whole: a line only when that is on."""
    engine = config.engine
    if engine.nonstream_decode is not NonstreamDecode.WHOLE:
        return []
    bound = engine.whole_answer_timeout_s
    timeout = f"within {bound:g} s" if bound else "within the request deadline"
    return [f"  non-streaming decodes: whole answers, forwarded as sent, {timeout}"]


def tracing_summary(tracing: TracingConfig) -> str:
    if tracing.enabled is False:
        return "off"
    if tracing.enabled is None:
        return "on only if the environment names an OTLP endpoint (OTEL_EXPORTER_OTLP_*)"
    return f"on, to {tracing.endpoint or 'the OTLP endpoint of the environment, or the default'}"

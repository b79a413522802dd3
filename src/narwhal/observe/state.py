"""`/narwhal/state`: the router's live view of its fleet, as JSON-ready data."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from narwhal.config.tenants import TenantConfig
from narwhal.engines.scrape import EXTERNAL, LOCAL_COMPUTE
from narwhal.fleet.table import Engine, Phase
from narwhal.router.abandoned import AbandonedHandoffs

if TYPE_CHECKING:
    from narwhal.observe.parts import AdmissionSeen, Observed


def snapshot(router: Observed) -> dict[str, Any]:
    """Each engine's standing, seats, breaker and failures; the queue, budget and recent
    requests; with `[[tenants]]`, each tenant's. Read by operators and the fleet page;
    never on the request path."""
    now = asyncio.get_running_loop().time()
    state: dict[str, Any] = {
        "model": router.config.model,
        "in_flight": router.in_flight,
        "queued": router.fleet.queued,
        "queue_capacity": router.fleet.queue_capacity,
        "open_engine_legs": router.client.open_legs,
        # A phase with no admitted engine: requests go by aggregate fallback or panic.
        "degraded": router.fleet.degraded(),
        # Whether a request could be placed at all (`/health` says the same).
        "can_serve": router.fleet.can_serve(),
        "engine_contract": (
            router.config.engine_contract.pinned() if router.config.engine_contract else None
        ),
        "retry_budget": {
            "credit": round(router.budget.credit, 3),
            "size": router.budget.initial,
            "spent": router.budget.spent,
            "denied": router.budget.denied,
        },
        "continuation": {
            "enabled": router.config.continuation.enabled,
            "continued": router.continuation_counts.continued,
            "not_continued": router.continuation_counts.not_continued,
            "credit": round(router.continuation_budget.credit, 3),
            "size": router.continuation_budget.initial,
        },
        "recent": router.recent.summary(time.perf_counter()),
        "engines": [engine_entry(engine, now, router.abandoned) for engine in router.fleet.engines],
        "models": models(router, now),
        "controller": (
            router.controller.summary() if router.controller is not None else {"enabled": False}
        ),
        "discovery": (
            router.discovery.summary() if router.discovery is not None else {"enabled": False}
        ),
        "placement": _placement(router),
    }
    admission = router.admission
    if admission is not None:
        state["tenants"] = tenants(router, admission)
    return state


def tenants(router: Observed, admission: AdmissionSeen) -> dict[str, Any]:
    """Per tenant: its settings (band, weight, whether it is the default tenant, its
    limits as configured and as this router's share), its requests in flight (`in_flight`:
    the whole router's, counted in the limits' store, None for a tenant without limits;
    `in_flight_here`: this process's), queued here, its buckets' levels now (None without
    that limit) and its recent mean request duration. The last minutes' outcomes per
    tenant are in `recent.tenants`."""
    limits = admission.limits.state(time.monotonic())
    queued = router.fleet.queued_by_tenant()
    default = admission.policy.default
    shown: dict[str, Any] = {}
    for name, config in admission.tenants.items():
        held = limits.get(name) or {}
        shown[name] = {
            **tenant_settings(config),
            "default": name == default,
            "share": held.get("share"),
            "in_flight": held.get("in_flight"),
            "in_flight_here": held.get("in_flight_here", 0),
            "queued": queued.get(name, 0),
            "requests_level": held.get("requests_level"),
            "tokens_level": held.get("tokens_level"),
            "mean_duration_s": _rounded(held.get("mean_duration_s")),
        }
    return shown


def tenant_settings(config: TenantConfig) -> dict[str, Any]:
    """A tenant's band, weight and limits as configured (or changed since)."""
    return {
        "priority": config.priority,
        "weight": config.weight,
        "limits": {
            "max_concurrent": config.max_concurrent,
            "max_queued": config.max_queued,
            "requests_per_minute": config.requests_per_minute,
            "tokens_per_minute": config.tokens_per_minute,
            "ttft_objective_s": config.ttft_objective_s,
        },
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def models(router: Observed, now: float) -> dict[str, Any]:
    """Per pool (base model): its engines by the phase they serve now, how many of those
    are admitted, whether it can place a request and is degraded, and its adapters with
    the engines holding each (configured adapters no engine holds yet listed empty)."""
    fleet = router.fleet
    pools: dict[str, Any] = {}
    for model in fleet.models():
        members = fleet.pool(model)
        held: dict[str, list[str]] = {
            adapter.name: [] for adapter in router.config.lora.adapters if adapter.base == model
        }
        for engine in members:
            for adapter in engine.adapters:
                held.setdefault(adapter, []).append(engine.id)
        by_phase = {phase.value: [e.id for e in members if e.serves(phase)] for phase in Phase}
        admitted = {phase.value: len(fleet.admitted(phase, now, members)) for phase in Phase}
        pools[model] = {
            "engines": by_phase,
            "admitted": admitted,
            "can_serve": fleet.can_serve(model),
            "degraded": not all(admitted.values()),
            "adapters": held,
        }
    return pools


def _placement(router: Observed) -> dict[str, Any]:
    """The policy, how many placements a cached prefix steered, and per engine the chunks
    the index holds, its recent placements and its KV event feed (this process's)."""
    placer = router.fleet.placer
    feeds = router.kv_events.stats
    recent = {phase: placer.recent(phase) for phase in ("prefill", "decode")}
    return {
        "policy": placer.policy.value,
        "steered": dict(placer.steered),
        "by_load": dict(placer.by_load),
        "engines": {
            engine.id: {
                "indexed_chunks": placer.index.size(engine.id),
                "recent": {phase: counts[engine.id] for phase, counts in recent.items()},
                "kv_events": feeds[engine.id].as_json() if engine.id in feeds else None,
            }
            for engine in router.fleet.engines
        },
    }


def engine_entry(
    engine: Engine, now: float, abandoned: AbandonedHandoffs | None = None
) -> dict[str, Any]:
    """One engine as `/narwhal/state` and the admin API show it."""
    return {
        "id": engine.id,
        "url": engine.url,
        "role": engine.spec.role.value,
        # Its pool, and the LoRA adapters it holds (least recently used first).
        "model": engine.model,
        "adapters": list(engine.adapters),
        # The phase it serves now: its role, or for a role `both` engine the one it acts in.
        "acting": engine.role.value,
        "state": engine.state(now).value,
        "quarantined_for_s": round(max(0.0, engine.quarantined_until - now), 3),
        "streak": engine.streak,
        "ejection_reason": engine.ejection_reason if engine.ejected else None,
        "ejections": engine.ejections,
        "spared": engine.spares,
        "panic_placements": engine.panics,
        "refusing": engine.refusing,
        "probes": dict(engine.probes),
        # Set by operators (see `operations`): stored for a role controller, shown here.
        "pinned": engine.pinned,
        # A reload or discovery dropped it: deleted once drained.
        "removing": engine.remove_when_drained,
        # None: the config file or the admin API; "kubernetes": discovery.
        "source": engine.source,
        # `limit`: the engine's (0: none); `share`: this process's part of it (`seat_share`).
        "seats": {
            "prefill": {
                "in_use": engine.prefill_seats,
                "limit": engine.spec.max_prefill_seats,
                "share": engine.seat_limit(Phase.PREFILL),
            },
            "decode": {
                "in_use": engine.decode_seats,
                "limit": engine.spec.max_decode_seats,
                "share": engine.seat_limit(Phase.DECODE),
            },
        },
        # Requests other routers have on it, by its last report.
        "others": engine.others,
        "failures": dict(engine.failures),
        "reported": _reported(engine),
        "kv": _kv_use(engine),
        # Producers only: handoffs dropped undelivered, and blocks still pinned.
        "abandoned": (
            abandoned.summary(engine.id, now)
            if abandoned is not None and engine.serves(Phase.PREFILL)
            else None
        ),
    }


def _reported(engine: Engine) -> dict[str, Any] | None:
    """The engine's own load at its last `/metrics` reading (None before the first)."""
    report = engine.report
    if report is None:
        return None
    return {
        "running": report.running,
        "waiting": report.waiting,
        "kv_cache_usage": report.kv_cache_usage,
    }


def _kv_use(engine: Engine) -> dict[str, Any]:
    """Crossed decodes the router sent the engine beside the prompt tokens the engine says
    it pulled (`external_kv_transfer`) or computed (`local_compute`) since the router
    started; `transfer_share` is None until the engine has counted either."""
    tokens = engine.prompt_tokens
    pulled, computed = tokens.get(EXTERNAL, 0.0), tokens.get(LOCAL_COMPUTE, 0.0)
    return {
        "crossed_decodes": engine.crossed_decodes,
        "prompt_tokens": dict(tokens),
        "transfer_share": round(pulled / (pulled + computed), 4) if pulled + computed else None,
        "silent_recomputes": engine.silent_recomputes,
    }

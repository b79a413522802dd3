"""One `/narwhal/state` for the whole router out of each worker's own.

Each worker places, judges and counts for itself; the merged view adds up what each holds
and shows where their judgments differ:

| field                                   | merged as                                      |
|-----------------------------------------|------------------------------------------------|
| in flight, queued, open legs, seats in  | sum                                            |
|   use, retry budget, failures, probes,  |                                                |
|   ejections, panics, crossed decodes    |                                                |
| degraded, can_serve, refusing           | any worker                                     |
| engine `state`                          | the workers' common state; when they differ,   |
|                                         |   the most severe (`worker_states` has each)   |
| streak, quarantine left                 | max                                            |
| seat shares                             | sum (the router's part of the engine's limit)  |
| `others` (requests not this worker's)   | each worker's, by worker                       |
| the engine's own report, prompt tokens  | the freshest worker's (the same engine counts) |
| recent requests                         | counts summed; percentiles: the worst worker's |
| placement: steered, by load, recent     | sum (each worker places for itself)            |
|   placements                            |                                                |
| placement: an engine's KV event feed    | the freshest worker's (each worker subscribes  |
|                                         |   to the same events)                          |
| placement: each engine's indexed chunks | sum, and each worker's (`indexed_by_worker`):  |
|                                         |   every worker keeps a prefix index of its own |
| models: each pool's engines by phase,   | every worker's, in order; admitted: the merged |
|   adapters and their holders            |   engines admitted; can_serve, degraded: any   |
| tenants: in flight here, queued         | sum                                            |
| tenants: in flight (the shared store's) | max (each worker read the same count)          |
| tenants: bucket levels                  | min (the same buckets, read at other instants) |
| tenants: mean request duration          | max                                            |
| tenants: settings and limits            | the first worker's that lists the tenant       |

Pure: the workers' snapshots in, one snapshot out.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Most severe first: a state some worker holds ranks the engine among the out.
SEVERITY = ("ejected", "held", "quarantined", "draining", "drained", "admitted")


def merge_states(snapshots: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """`snapshots`: each answering worker's `/narwhal/state`, by worker number."""
    parts = [snapshots[worker] for worker in sorted(snapshots)]
    first = parts[0]
    engines = _merge_engines({w: snapshots[w]["engines"] for w in sorted(snapshots)})
    merged = {
        **first,
        "in_flight": _sum(parts, "in_flight"),
        "queued": _sum(parts, "queued"),
        "queue_capacity": _sum(parts, "queue_capacity"),
        "open_engine_legs": _sum(parts, "open_engine_legs"),
        "degraded": any(part["degraded"] for part in parts),
        "can_serve": any(part["can_serve"] for part in parts),
        "retry_budget": _sum_fields([part["retry_budget"] for part in parts]),
        "recent": merge_recent([part["recent"] for part in parts]),
        "engines": engines,
        "models": merge_models([part.get("models") or {} for part in parts], engines),
        "placement": merge_placement({w: snapshots[w]["placement"] for w in sorted(snapshots)}),
    }
    tenants = [part["tenants"] for part in parts if part.get("tenants") is not None]
    if tenants:
        merged["tenants"] = merge_tenants(tenants)
    return merged


def merge_tenants(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The workers' tenants sections: what each worker holds (its requests, its queue)
    summed; what they share (the limits' store) shown once; every tenant any lists."""
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, entry in part.items():
            into = merged.get(name)
            if into is None:
                merged[name] = dict(entry)
                continue
            into["in_flight_here"] = into.get("in_flight_here", 0) + entry.get("in_flight_here", 0)
            into["queued"] = into.get("queued", 0) + entry.get("queued", 0)
            into["in_flight"] = _known(max, into.get("in_flight"), entry.get("in_flight"))
            for key in ("requests_level", "tokens_level"):
                into[key] = _known(min, into.get(key), entry.get(key))
            into["mean_duration_s"] = _known(
                max, into.get("mean_duration_s"), entry.get("mean_duration_s")
            )
    return merged


def _known(pick: Callable[[Any, Any], Any], first: Any, second: Any) -> Any:
    """`pick` of the two where both are known (not None), else the one that is."""
    if first is None or second is None:
        return second if first is None else first
    return pick(first, second)


def merge_models(
    parts: Sequence[Mapping[str, Any]], engines: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The workers' pools (`parts`): engines and adapter holders as any worker lists them;
    a phase's admitted engines counted over the merged `engines`, whose state is the most
    severe any worker holds."""
    states = {engine["id"]: engine["state"] for engine in engines}
    merged: dict[str, Any] = {}
    for part in parts:
        for model, pool in part.items():
            into = merged.setdefault(
                model,
                {"engines": {}, "admitted": {}, "can_serve": False, "degraded": False},
            )
            for phase, ids in pool["engines"].items():
                listed = into["engines"].setdefault(phase, [])
                listed += [i for i in ids if i not in listed]
            holders = into.setdefault("adapters", {})
            for adapter, ids in pool["adapters"].items():
                listed = holders.setdefault(adapter, [])
                listed += [i for i in ids if i not in listed]
            into["can_serve"] = into["can_serve"] or pool["can_serve"]
            into["degraded"] = into["degraded"] or pool["degraded"]
    for pool in merged.values():
        pool["admitted"] = {
            phase: sum(states.get(i) == "admitted" for i in ids)
            for phase, ids in pool["engines"].items()
        }
        pool["degraded"] = pool["degraded"] or not all(pool["admitted"].values())
    return merged


def merge_placement(by_worker: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The workers' placement views (`by_worker`): their counts summed, and each engine's
    prefix index shown both summed and by worker, as each worker indexes what it placed."""
    merged = copy.deepcopy(_sum_fields([by_worker[worker] for worker in sorted(by_worker)]))
    for engine_id, entry in merged["engines"].items():
        views = {
            str(worker): view["engines"][engine_id]
            for worker, view in sorted(by_worker.items())
            if engine_id in view["engines"]
        }
        entry["indexed_by_worker"] = {w: view["indexed_chunks"] for w, view in views.items()}
        feeds: list[Mapping[str, Any]] = [
            view["kv_events"] for view in views.values() if view["kv_events"] is not None
        ]
        freshest = max(feeds, key=_batches) if feeds else None
        entry["kv_events"] = None if freshest is None else {**freshest}
    return merged


def _batches(feed: Mapping[str, Any]) -> int:
    batches: int = feed.get("batches", 0)
    return batches


def _sum(parts: Sequence[Mapping[str, Any]], key: str) -> Any:
    return sum(part[key] for part in parts)


def _sum_fields(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Numbers summed key by key (nested tables too); anything else: the first's."""
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if merged.get(key) is None:
                merged[key] = dict(value) if isinstance(value, Mapping) else value
            elif isinstance(value, Mapping) and isinstance(merged[key], Mapping):
                merged[key] = _sum_fields([merged[key], value])
            elif _number(value) and _number(merged[key]):
                merged[key] = round(merged[key] + value, 6)
    return merged


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _merge_engines(by_worker: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    entries: dict[str, dict[int, Mapping[str, Any]]] = {}
    for worker, engines in by_worker.items():
        for engine in engines:
            entries.setdefault(engine["id"], {})[worker] = engine
    return [merge_engine(views) for views in entries.values()]


def merge_engine(views: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """One engine as all workers see it (`views` by worker number)."""
    parts = [views[worker] for worker in sorted(views)]
    states = {str(worker): views[worker]["state"] for worker in sorted(views)}
    reports = [part["reported"] for part in parts if part["reported"] is not None]
    kv = _sum_fields([part["kv"] for part in parts])
    # The engine's own counts of its prompt tokens: the same engine, read by each worker.
    freshest_kv = max(parts, key=lambda part: sum(part["kv"]["prompt_tokens"].values()))["kv"]
    kv["prompt_tokens"] = dict(freshest_kv["prompt_tokens"])
    kv["transfer_share"] = freshest_kv["transfer_share"]
    abandoned = [part["abandoned"] for part in parts if part["abandoned"] is not None]
    return {
        **parts[0],
        "state": min(states.values(), key=_severity),
        "worker_states": states,
        "quarantined_for_s": max(part["quarantined_for_s"] for part in parts),
        "streak": max(part["streak"] for part in parts),
        "ejection_reason": next(
            (part["ejection_reason"] for part in parts if part["ejection_reason"]), None
        ),
        "ejections": _sum(parts, "ejections"),
        "spared": _sum(parts, "spared"),
        "panic_placements": _sum(parts, "panic_placements"),
        "refusing": any(part["refusing"] for part in parts),
        "probes": _sum_fields([part["probes"] for part in parts]),
        "seats": _merge_seats([part["seats"] for part in parts]),
        # What each worker counts as other routers' requests (its siblings' among them).
        "others": {str(worker): views[worker]["others"] for worker in sorted(views)},
        "failures": _sum_fields([part["failures"] for part in parts]),
        "reported": reports[-1] if reports else None,
        "kv": kv,
        "abandoned": _sum_fields(abandoned) if abandoned else None,
    }


def _merge_seats(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Seats in use and the workers' shares summed; the engine's limit shown once."""
    return {
        phase: {
            "in_use": sum(part[phase]["in_use"] for part in parts),
            "limit": first["limit"],
            "share": None
            if first["share"] is None
            else sum(part[phase]["share"] for part in parts),
        }
        for phase, first in parts[0].items()
    }


def _severity(state: str) -> int:
    return SEVERITY.index(state) if state in SEVERITY else len(SEVERITY)


def merge_recent(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts and rates summed; each percentile the highest any worker saw (a bound, since
    percentiles of parts do not make the percentile of the whole)."""
    merged = _sum_fields([{k: v for k, v in part.items() if k != "series"} for part in parts])
    merged["window_s"], merged["bucket_s"] = parts[0]["window_s"], parts[0]["bucket_s"]
    for key in ("ttft_s", "first_byte_s"):
        present = [part[key] for part in parts if part[key] is not None]
        merged[key] = {q: max(p[q] for p in present) for q in present[0]} if present else None
    series: dict[float, dict[str, Any]] = {}
    for part in parts:
        for bucket in part["series"]:
            series[bucket["ago_s"]] = _sum_fields([series.get(bucket["ago_s"], {}), bucket])
            series[bucket["ago_s"]]["ago_s"] = bucket["ago_s"]
    merged["series"] = [series[ago] for ago in sorted(series, reverse=True)]
    return merged

"""Merging the workers' `/narwhal/state`: what each holds adds up; where they differ shows."""

from __future__ import annotations

from typing import Any

from narwhal.workers.merge_state import merge_placement, merge_states


def engine(state: str = "admitted", in_use: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "id": "d0",
        "url": "http://d0",
        "role": "decode",
        "acting": "decode",
        "state": state,
        "quarantined_for_s": 0.0,
        "streak": 0,
        "ejection_reason": None,
        "ejections": 0,
        "spared": 0,
        "panic_placements": 0,
        "refusing": False,
        "probes": {},
        "pinned": False,
        "removing": False,
        "seats": {
            "prefill": {"in_use": 0, "limit": 0, "share": None},
            "decode": {"in_use": in_use, "limit": 8, "share": 4},
        },
        "others": 0.0,
        "failures": {},
        "reported": None,
        "kv": {
            "crossed_decodes": 0,
            "prompt_tokens": {},
            "transfer_share": None,
            "silent_recomputes": 0,
        },
        "abandoned": None,
        **extra,
    }


def snapshot(in_flight: int, engines: list[dict[str, Any]], p90: float | None) -> dict[str, Any]:
    return {
        "model": "m",
        "in_flight": in_flight,
        "queued": 0,
        "queue_capacity": 64,
        "open_engine_legs": in_flight,
        "degraded": False,
        "can_serve": True,
        "engine_contract": None,
        "retry_budget": {"credit": 10.0, "size": 10, "spent": 1, "denied": 0},
        "recent": {
            "window_s": 300.0,
            "bucket_s": 10.0,
            "requests": in_flight,
            "rate_per_s": 1.0,
            "outcomes": {"ok": in_flight},
            "handoffs": {},
            "ttft_s": None if p90 is None else {"p50": p90 / 2, "p90": p90, "p99": p90},
            "first_byte_s": None,
            "series": [{"ago_s": 0.0, "ok": in_flight}],
        },
        "engines": engines,
        "controller": {"enabled": False},
        "placement": placement({e["id"]: 0 for e in engines}),
    }


def placement(
    indexed: dict[str, int], steered: int = 0, feed: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A worker's placement view, as `observe.state` shows it."""
    return {
        "policy": "prefix",
        "steered": {"prefill": steered, "decode": 0},
        "by_load": {"prefill": 1, "decode": 1},
        "engines": {
            engine_id: {
                "indexed_chunks": chunks,
                "recent": {"prefill": 0, "decode": 2},
                "kv_events": feed,
            }
            for engine_id, chunks in indexed.items()
        },
    }


def test_what_each_worker_holds_adds_up() -> None:
    merged = merge_states(
        {
            0: snapshot(2, [engine(in_use=2, failures={"refused": 1})], None),
            1: snapshot(3, [engine(in_use=3, failures={"refused": 2, "decode": 1})], 0.4),
        }
    )
    assert merged["in_flight"] == 5 and merged["open_engine_legs"] == 5
    assert merged["retry_budget"] == {"credit": 20.0, "size": 20, "spent": 2, "denied": 0}
    (d0,) = merged["engines"]
    assert d0["seats"]["decode"] == {"in_use": 5, "limit": 8, "share": 8}
    assert d0["seats"]["prefill"]["share"] is None
    assert d0["failures"] == {"refused": 3, "decode": 1}
    assert merged["recent"]["requests"] == 5
    assert merged["recent"]["series"] == [{"ago_s": 0.0, "ok": 5}]
    assert merged["recent"]["ttft_s"] == {"p50": 0.2, "p90": 0.4, "p99": 0.4}


def test_workers_that_judge_an_engine_differently_show_it_at_its_worst() -> None:
    merged = merge_states(
        {
            0: snapshot(0, [engine("admitted")], None),
            1: snapshot(0, [engine("ejected", streak=3, ejection_reason="3 failures")], None),
        }
    )
    (d0,) = merged["engines"]
    assert d0["state"] == "ejected"
    assert d0["worker_states"] == {"0": "admitted", "1": "ejected"}
    assert d0["streak"] == 3 and d0["ejection_reason"] == "3 failures"


def test_an_engine_only_some_workers_know_is_listed_once() -> None:
    other = {**engine(), "id": "d1"}
    merged = merge_states(
        {0: snapshot(0, [engine()], None), 1: snapshot(0, [engine(), other], None)}
    )
    assert [e["id"] for e in merged["engines"]] == ["d0", "d1"]
    assert merged["engines"][1]["worker_states"] == {"1": "admitted"}


def test_placement_adds_up_and_shows_each_workers_index() -> None:
    feed = {"endpoint": "tcp://d0:5557", "batches": 3, "stored_blocks": 4, "removed_blocks": 1}
    # The same engine's events, of which worker 1 has read fewer yet.
    behind = {**feed, "batches": 2, "stored_blocks": 3}
    workers = {
        0: placement({"d0": 30}, steered=2, feed=feed),
        1: placement({"d0": 12, "d1": 5}, steered=3, feed=behind),
    }
    merged = merge_placement(workers)
    assert merged["policy"] == "prefix"
    assert merged["steered"] == {"prefill": 5, "decode": 0}
    assert merged["by_load"] == {"prefill": 2, "decode": 2}
    d0, d1 = merged["engines"]["d0"], merged["engines"]["d1"]
    assert d0["indexed_chunks"] == 42 and d0["indexed_by_worker"] == {"0": 30, "1": 12}
    assert d0["recent"] == {"prefill": 0, "decode": 4}
    # Each worker reads the same events: the freshest feed, not a double count.
    assert d0["kv_events"] == feed
    assert d1["indexed_chunks"] == 5 and d1["indexed_by_worker"] == {"1": 5}
    assert d1["kv_events"] == behind
    # The workers' own views are left as they were, also when one worker answers alone.
    assert "indexed_by_worker" not in workers[0]["engines"]["d0"]
    assert workers[0]["steered"] == {"prefill": 2, "decode": 0}
    alone = merge_placement({0: workers[0]})
    assert alone["engines"]["d0"]["indexed_by_worker"] == {"0": 30}
    assert "indexed_by_worker" not in workers[0]["engines"]["d0"]
    assert alone["engines"]["d0"]["kv_events"] is not feed


def test_the_merged_state_carries_the_merged_placement() -> None:
    merged = merge_states({0: snapshot(1, [engine()], None), 1: snapshot(1, [engine()], None)})
    assert merged["placement"]["engines"]["d0"]["indexed_by_worker"] == {"0": 0, "1": 0}
    assert merged["placement"]["engines"]["d0"]["recent"]["decode"] == 4


def pool(decode: list[str], admitted: int, **adapters: list[str]) -> dict[str, Any]:
    return {
        "engines": {"prefill": [], "decode": decode},
        "admitted": {"prefill": 0, "decode": admitted},
        "can_serve": bool(admitted),
        "degraded": True,
        "adapters": adapters,
    }


def test_pools_list_every_workers_engines_and_count_the_merged_admitted() -> None:
    a0, b0 = engine(), {**engine(), "id": "e0"}
    first = {
        **snapshot(0, [a0, b0], None),
        "models": {"m": pool(["d0"], 1, sql=["d0"]), "n": pool(["e0"], 1)},
    }
    # Worker 1 has ejected d0 and seen it load another adapter; it knows e0 too.
    second = {
        **snapshot(0, [engine("ejected"), b0], None),
        "models": {"m": pool(["d0"], 0, sql=["d0"], poet=["d0"]), "n": pool(["e0"], 1)},
    }
    merged = merge_states({0: first, 1: second})["models"]
    assert list(merged) == ["m", "n"]
    assert merged["m"]["engines"] == {"prefill": [], "decode": ["d0"]}
    # d0 is out on one worker: the merged state counts it out, as its engine entry says.
    assert merged["m"]["admitted"] == {"prefill": 0, "decode": 0}
    assert merged["m"]["adapters"] == {"sql": ["d0"], "poet": ["d0"]}
    assert merged["m"]["can_serve"] and merged["m"]["degraded"]
    assert merged["n"]["admitted"] == {"prefill": 0, "decode": 1}
    # The workers' own views are left as they were.
    assert first["models"]["m"]["adapters"] == {"sql": ["d0"]}


def tenant(in_flight: int | None, here: int, queued: int, **levels: float | None) -> Any:
    """One worker's view of a tenant, as `observe.state` shows it."""
    return {
        "priority": 1,
        "weight": 2.0,
        "default": False,
        "limits": {"max_concurrent": 8, "requests_per_minute": 60},
        "share": {"max_concurrent": 8, "requests_per_minute": 60, "tokens_per_minute": None},
        "in_flight": in_flight,
        "in_flight_here": here,
        "queued": queued,
        "requests_level": levels.get("requests"),
        "tokens_level": None,
        "mean_duration_s": levels.get("duration"),
    }


def test_tenants_add_up_what_each_worker_holds_and_show_the_shared_store_once() -> None:
    first = snapshot(1, [engine()], None)
    second = snapshot(2, [engine()], None)
    first["tenants"] = {
        "search": tenant(5, 2, 1, requests=40.5, duration=0.8),
        "batch": tenant(None, 1, 4),
    }
    second["tenants"] = {"search": tenant(5, 3, 0, requests=39.0, duration=1.2)}
    first["recent"]["tenants"] = {"search": {"requests": 3, "outcomes": {"ok": 3}, "refused": 0}}
    second["recent"]["tenants"] = {
        "search": {"requests": 2, "outcomes": {"ok": 1, "client_error": 1}, "refused": 1}
    }
    merged = merge_states({0: first, 1: second})
    search = merged["tenants"]["search"]
    # The store's count is the router's: every worker read it, none adds to it.
    assert (search["in_flight"], search["in_flight_here"], search["queued"]) == (5, 5, 1)
    assert search["requests_level"] == 39.0 and search["tokens_level"] is None
    assert search["mean_duration_s"] == 1.2
    assert (search["priority"], search["weight"], search["limits"]["max_concurrent"]) == (1, 2, 8)
    # A tenant only one worker lists (a reload under way) is shown as that worker has it.
    assert merged["tenants"]["batch"] == tenant(None, 1, 4)
    assert merged["recent"]["tenants"] == {
        "search": {"requests": 5, "outcomes": {"ok": 4, "client_error": 1}, "refused": 1}
    }
    # Workers without tenants merge without the section.
    assert "tenants" not in merge_states({0: snapshot(1, [engine()], None)})

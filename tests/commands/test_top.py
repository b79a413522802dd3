"""`narwhal top`'s frame: the router's state as lines that fit the terminal."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from narwhal.commands.top import failures_of, render, status_word


def engine(name: str, role: str, **changes: Any) -> dict[str, Any]:
    return {
        "id": name,
        "url": f"http://{name}:8000",
        "role": role,
        "model": "whale-7b",
        "adapters": [],
        "state": "admitted",
        "quarantined_for_s": 0.0,
        "ejection_reason": None,
        "seats": {"prefill": {"in_use": 2, "limit": 64}, "decode": {"in_use": 5, "limit": 0}},
        "failures": {},
        "reported": {"running": 3.0, "waiting": 1.0, "kv_cache_usage": 0.25},
        "abandoned": (
            {"handoffs": 4, "blocks": 40, "block_seconds": 900.5, "pinned_blocks": 10}
            if role != "decode"
            else None
        ),
        **changes,
    }


STATE: dict[str, Any] = {
    "model": "whale-7b",
    "in_flight": 7,
    "queued": 1,
    "queue_capacity": 1024,
    "open_engine_legs": 6,
    "degraded": False,
    "can_serve": True,
    "retry_budget": {"credit": 9.5, "size": 10, "spent": 3, "denied": 0},
    "recent": {
        "window_s": 300.0,
        "requests": 42,
        "rate_per_s": 0.7,
        "outcomes": {"ok": 40, "error": 2},
        "handoffs": {"crossed": 41, "recomputed": 1},
        "ttft_s": {"p50": 0.012, "p90": 0.2, "p99": 1.5},
        "first_byte_s": None,
        "series": [],
    },
    "engines": [engine("p0", "prefill"), engine("d0", "decode")],
}


def test_a_frame_shows_the_router_requests_and_engines() -> None:
    lines = render(STATE, 120, url="http://router:8000", clock="12:00:00")
    text = "\n".join(lines)
    assert lines[0] == "narwhal top · http://router:8000 · model whale-7b · serving · 12:00:00"
    assert "in flight 7 · queued 1/1024 · engine legs 6 · retry credit 9/10" in text
    assert "requests (last 5 min): 42 · 0.70/s · ok 40 · error 2" in text
    assert "handoffs: crossed 41 · recomputed 1" in text
    assert "  ttft          12 ms   200 ms   1.50 s" in text
    assert "  first byte        -        -        -" in text
    header = next(line for line in lines if line.startswith("ENGINE"))
    assert header.split() == [
        "ENGINE", "MODEL", "ROLE", "STATE", "PREFILL", "DECODE", "RUN", "WAIT", "KV", "ABANDONED",
        "PINNED",
    ]  # fmt: skip
    p0 = next(line for line in lines if line.startswith("p0 "))
    assert p0.split() == [
        "p0", "whale-7b", "prefill", "admitted", "2/64", "-", "3", "1", "25%", "4", "10"
    ]  # fmt: skip
    d0 = next(line for line in lines if line.startswith("d0 "))
    # An unlimited seat count shows its limit as "-"; a consumer abandons nothing.
    assert d0.split() == [
        "d0", "whale-7b", "decode", "admitted", "-", "5/-", "3", "1", "25%", "-", "-"
    ]  # fmt: skip
    assert lines[-3:] == ["  none", "", "q quits"]


@pytest.mark.parametrize("width", [20, 40, 79, 160])
def test_every_line_fits_the_width(width: int) -> None:
    for line in render(STATE, width, url="http://a-very-long-router-host-name:8000"):
        assert len(line) <= width, line


def test_a_cut_line_ends_in_an_ellipsis() -> None:
    assert render(STATE, 20)[0] == "narwhal top · model…"


def test_failures_that_grew_since_the_window_began_are_recent() -> None:
    before = failures_of(STATE)
    now = copy.deepcopy(STATE)
    now["engines"][1]["failures"] = {"http_status": 3, "connect": 1}
    lines = render(now, 120, before={"d0": {"http_status": 1}})
    start = lines.index("recent failures")
    assert lines[start + 1] == "  d0: connect +1 (1), http_status +2 (3)"
    # Counts that did not move are not news.
    assert render(now, 120, before=failures_of(now))[start + 1] == "  none"
    assert before == {"p0": {}, "d0": {}}


def test_an_engine_out_shows_why_and_the_fleet_is_degraded() -> None:
    state = copy.deepcopy(STATE)
    state["engines"][0].update(state="ejected", ejection_reason="3 failures;\x1b[2J cleared")
    state["engines"][1].update(state="quarantined", quarantined_for_s=4.25)
    lines = render(state, 120)
    assert "degraded" in lines[0]
    # The engine's text is shown, never its control characters.
    assert "  p0 ejected: 3 failures; [2J cleared" in lines
    assert "  d0 quarantined for another 4.2 s" in lines
    assert status_word({**state, "can_serve": False}) == "down"


def test_an_unreachable_router_is_said_so_over_its_last_state() -> None:
    assert render(None, 80, url="http://r:1", clock="t", error="refused", keys=False) == [
        "narwhal top · http://r:1 · t",
        "router unreachable: refused",
    ]
    lines = render(STATE, 80, error="timed out")
    assert lines[1] == "router unreachable: timed out (showing its last state)"
    assert any(line.startswith("p0 ") for line in lines)


def test_a_router_without_reports_or_recent_requests_shows_dashes() -> None:
    state = copy.deepcopy(STATE)
    del state["recent"]
    state["engines"][0]["reported"] = None
    p0 = next(line for line in render(state, 120) if line.startswith("p0 "))
    assert p0.split()[6:9] == ["-", "-", "-"]


def pool(prefill: list[str], decode: list[str], admitted: int, **adapters: list[str]) -> Any:
    return {
        "engines": {"prefill": prefill, "decode": decode},
        "admitted": {"prefill": admitted, "decode": admitted},
        "can_serve": bool(admitted),
        "degraded": not admitted,
        "adapters": adapters,
    }


def test_two_models_show_in_the_title_a_line_per_pool_and_the_model_column() -> None:
    state = copy.deepcopy(STATE)
    state["engines"] += [
        engine("p1", "prefill", model="orca-1b", state="ejected"),
        engine("d1", "decode", model="orca-1b", state="ejected", adapters=["sql"]),
    ]
    state["models"] = {
        "whale-7b": pool(["p0"], ["d0"], 1),
        "orca-1b": pool(["p1"], ["d1"], 0, sql=["d1"], poet=[]),
    }
    lines = render(state, 120, clock="t", keys=False)
    assert lines[0] == "narwhal top · models whale-7b, orca-1b · degraded · t"
    assert "whale-7b: prefill 1/1 · decode 1/1 admitted" in lines
    assert "orca-1b: prefill 0/1 · decode 0/1 admitted · down · adapters sql (1), poet (0)" in lines
    d1 = next(line for line in lines if line.startswith("d1 "))
    assert d1.split()[:3] == ["d1", "orca-1b", "decode"]


def test_one_pool_without_adapters_adds_no_pool_lines() -> None:
    state = {**STATE, "models": {"whale-7b": pool(["p0"], ["d0"], 1)}}
    assert render(state, 120) == render(STATE, 120)
    with_adapter = {**STATE, "models": {"whale-7b": pool(["p0"], ["d0"], 1, sql=["d0"])}}
    assert "whale-7b: prefill 1/1 · decode 1/1 admitted · adapters sql (1)" in render(
        with_adapter, 120
    )


def tenant(priority: int, **changes: Any) -> dict[str, Any]:
    return {
        "priority": priority,
        "weight": 1.0,
        "default": False,
        "limits": {
            "max_concurrent": None,
            "max_queued": None,
            "requests_per_minute": None,
            "tokens_per_minute": None,
            "ttft_objective_s": None,
        },
        "share": {"max_concurrent": None, "requests_per_minute": None, "tokens_per_minute": None},
        "in_flight": None,
        "in_flight_here": 0,
        "queued": 0,
        "requests_level": None,
        "tokens_level": None,
        "mean_duration_s": None,
        **changes,
    }


def with_tenants() -> dict[str, Any]:
    state = copy.deepcopy(STATE)
    state["tenants"] = {
        "search": tenant(
            0,
            weight=3.0,
            limits={
                "max_concurrent": 8,
                "max_queued": 16,
                "requests_per_minute": 600,
                "tokens_per_minute": 60000,
                "ttft_objective_s": 0.5,
            },
            share={"max_concurrent": 8, "requests_per_minute": 600, "tokens_per_minute": 60000},
            in_flight=5,
            in_flight_here=5,
            queued=2,
            requests_level=412.7,
            tokens_level=1234.5,
        ),
        "batch": tenant(2, default=True, in_flight_here=3, queued=9),
    }
    state["recent"]["tenants"] = {
        "search": {"requests": 30, "outcomes": {"ok": 30}, "refused": 0},
        "batch": {"requests": 12, "outcomes": {"ok": 10, "client_error": 2}, "refused": 2},
    }
    return state


def test_tenants_show_their_band_weight_load_recent_outcomes_and_limits() -> None:
    lines = render(with_tenants(), 160, keys=False)
    start = lines.index("tenants (ok and refused: last 5 min) · default batch")
    assert lines[start + 1].split() == [
        "TENANT", "BAND", "WEIGHT", "IN", "FLIGHT", "QUEUED", "OK", "REFUSED", "LIMITS"
    ]  # fmt: skip
    # In flight and queued out of the tenant's caps; its buckets' levels out of their limits.
    assert lines[start + 2].split() == [
        "search", "0", "3", "5/8", "2/16", "30", "0",
        "rpm", "412/600", "·", "tpm", "1.2k/60k", "·", "ttft", "500", "ms",
    ]  # fmt: skip
    # A tenant without limits: its requests in this router, uncapped.
    assert lines[start + 3].split() == ["batch", "2", "1", "3", "9", "10", "2", "-"]
    # The tenants come before the engines.
    assert start < next(i for i, line in enumerate(lines) if line.startswith("ENGINE"))


def test_a_router_without_tenants_shows_no_tenant_lines() -> None:
    lines = render(STATE, 160)
    assert not any(line.startswith(("tenants", "TENANT")) for line in lines)
    assert render({**STATE, "tenants": {}}, 160) == lines


@pytest.mark.parametrize("width", [20, 79])
def test_tenant_lines_fit_the_width(width: int) -> None:
    for line in render(with_tenants(), width):
        assert len(line) <= width, line

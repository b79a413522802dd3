"""The controller run of `narwhal goodput`: its router config, its report beside the static
splits, and one real run over simulated engines."""

from __future__ import annotations

from narwhal.tools.goodput.replay import (
    KV_LEASE_S,
    FleetProcess,
    SplitRun,
    controller_sections,
    router_config,
    run_split,
)
from narwhal.tools.goodput.report import controller_document, controller_table
from narwhal.tools.goodput.score import ALL, Outcome, Slo, split_stats
from narwhal.tools.goodput.traces import generate, phase_durations

SLO = Slo(ttft_s=0.6, tpot_s=0.014)


def test_the_controller_config_starts_every_engine_as_its_split() -> None:
    sections = controller_sections(SLO, speed=2.0)
    raw = router_config(
        ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"], 1, sections
    )
    assert [(e["role"], e["start_as"]) for e in raw["engines"]] == [
        ("both", "prefill"),
        ("both", "decode"),
        ("both", "decode"),
    ]
    assert raw["controller"]["enabled"] is True
    assert raw["controller"]["interval_s"] == 0.5
    assert raw["slo"] == {"ttft_s": 0.3, "tpot_s": 0.007}
    static = router_config(["http://127.0.0.1:1", "http://127.0.0.1:2"], 1)
    assert "controller" not in static
    assert [e["role"] for e in static["engines"]] == ["prefill", "decode"]


def test_the_report_compares_the_controller_with_the_best_static_split() -> None:
    durations = {"p": 10.0}
    good = [Outcome("p", True, 0.1, 0.001)] * 20
    bad = [Outcome("p", True, 5.0, 0.001)] * 20
    results = {
        1: split_stats(good[:10] + bad[:10], SLO, durations),
        2: split_stats(bad, SLO, durations),
    }
    run = SplitRun(
        1,
        2,
        good,
        1.0,
        0.0,
        0.0,
        controller={
            "moves": {"ttft_pressure": 1},
            "timeline": [
                {"engine": "e1", "from": "decode", "to": "prefill", "reason": "ttft_pressure"}
            ],
            "split": {"prefill": 2, "decode": 1, "both": 0},
        },
    )
    doc = controller_document(run, split_stats(good, SLO, durations), results)
    assert doc["vs_best_static"][ALL] == 2.0
    assert doc["moves"] == {"ttft_pressure": 1}
    shown = controller_table(doc, results, 3)
    assert "1P2D" in shown and "2.00x" in shown and "e1 decode->prefill (ttft_pressure)" in shown


async def test_a_controller_run_serves_every_request() -> None:
    fields = {
        "profile": "dev",
        "request_overhead_s": 0.0,
        "prefill_s_per_token": 0.0005,
        "inter_token_s": 0.01,
        "slowdown_per_seq": 0.1,
        "kv_pull_s_per_block": 0.0,
        "kv_lease_s": KV_LEASE_S,
    }
    trace = generate("shifting", seed=1, duration_s=4.0, rate=8, cycles=1, token_scale=0.1)
    async with FleetProcess(3, fields) as fleet:
        run = await run_split(fleet, 1, trace, 1.0, controller=controller_sections(SLO, 1.0))
    assert all(outcome.completed for outcome in run.outcomes)
    assert run.controller is not None and run.controller["enabled"] is True
    stats = split_stats(run.outcomes, SLO, phase_durations(trace, 4.0))
    assert stats[ALL].requests == len(trace)

"""Goodput arithmetic: SLO checks, percentiles, per-phase stats and the best split."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.tools.goodput.capacity import engine_seconds, suggested_rate
from narwhal.tools.goodput.command import add_goodput_arguments, load_trace, splits_of
from narwhal.tools.goodput.score import (
    ALL,
    Outcome,
    Slo,
    best_split,
    default_slo,
    percentile,
    phase_stats,
    split_stats,
)
from narwhal.tools.goodput.traces import DECODE_HEAVY, PREFILL_HEAVY, TraceRequest, to_jsonl
from narwhal.tools.sim.options import profile_options

SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def test_a_request_is_good_only_when_it_meets_both_slos() -> None:
    assert Outcome("p", True, 0.5, 0.01).good(SLO)
    assert Outcome("p", True, 1.0, 0.05).good(SLO)  # at the limit counts
    assert not Outcome("p", True, 1.5, 0.01).good(SLO)
    assert not Outcome("p", True, 0.5, 0.08).good(SLO)
    assert not Outcome("p", False).good(SLO)
    assert Outcome("p", True, 0.5, None).good(SLO)  # one token: no TPOT


def test_pressure_is_the_tighter_slo_share_and_infinite_for_a_failure() -> None:
    assert Outcome("p", True, 0.5, 0.04).pressure(SLO) == pytest.approx(0.8)
    assert math.isinf(Outcome("p", False).pressure(SLO))


def test_percentiles_interpolate() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 90) == pytest.approx(90)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50))
def test_percentiles_are_ordered_and_within_the_data(values: list[float]) -> None:
    p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
    assert p50 is not None and p90 is not None and p99 is not None
    assert min(values) <= p50 <= p90 <= p99 <= max(values)


def test_goodput_is_good_requests_per_second_of_the_phase() -> None:
    outcomes = [Outcome("a", True, 0.1, 0.01)] * 6 + [Outcome("a", True, 2.0, 0.01)] * 4
    stats = phase_stats(outcomes, SLO, duration_s=2.0)
    assert (stats.requests, stats.completed, stats.good) == (10, 10, 6)
    assert stats.goodput_rps == pytest.approx(3.0)
    assert stats.ttft_s.p50 == pytest.approx(0.1)


def test_split_stats_cover_each_phase_and_the_whole() -> None:
    outcomes = [Outcome("a", True, 0.1, 0.01), Outcome("b", False), Outcome("b", True, 0.1)]
    stats = split_stats(outcomes, SLO, {"a": 1.0, "b": 3.0})
    assert list(stats) == ["a", "b", ALL]
    assert (stats["a"].good, stats["b"].good, stats[ALL].good) == (1, 1, 2)
    assert stats[ALL].goodput_rps == pytest.approx(0.5)


def test_the_best_split_has_the_most_goodput_then_the_most_room() -> None:
    good, slow = Outcome("x", True, 0.2, 0.01), Outcome("x", True, 0.9, 0.01)
    bad = Outcome("x", True, 5.0, 0.01)
    results = {
        1: split_stats([good, bad], SLO, {"x": 1.0}),
        2: split_stats([slow, slow], SLO, {"x": 1.0}),
        3: split_stats([good, good], SLO, {"x": 1.0}),
    }
    assert best_split(results) == 3
    assert best_split({k: results[k] for k in (1, 2)}) == 2
    assert best_split({}) is None
    assert best_split(results, "no such phase") is None


def test_default_slos_follow_the_profile() -> None:
    fast = profile_options("llama-3.1-8b-h100")
    slow = profile_options("llama-3.1-70b-h100-tp4")
    fast_slo = default_slo(fast.step_costs, fast.request_overhead_s)
    slow_slo = default_slo(slow.step_costs, slow.request_overhead_s)
    assert 0.3 < fast_slo.ttft_s < 1.5 and 0.01 < fast_slo.tpot_s < 0.04
    assert slow_slo.ttft_s > fast_slo.ttft_s and slow_slo.tpot_s > fast_slo.tpot_s


def test_the_suggested_rate_grows_with_engines_and_shrinks_with_longer_work() -> None:
    costs = profile_options("llama-3.1-8b-h100").step_costs
    assert suggested_rate(costs, 8, PREFILL_HEAVY) == pytest.approx(
        2 * suggested_rate(costs, 4, PREFILL_HEAVY)
    )
    assert engine_seconds(costs, PREFILL_HEAVY) > 0.05  # ~3000 prompt tokens of compute
    assert engine_seconds(costs, DECODE_HEAVY) > 0


def test_splits_default_to_every_static_split_and_are_checked() -> None:
    assert splits_of(None, 4) == [1, 2, 3]
    assert splits_of("3,1,1", 4) == [1, 3]
    for bad in ("0", "4", ""):
        with pytest.raises(ValueError, match=r"1\.\.3"):
            splits_of(bad, 4)


def test_a_jsonl_trace_file_is_read_as_given(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(to_jsonl([TraceRequest(0.5, 10, 3, "a"), TraceRequest(2.0, 20, 4, "b")]))
    parser = argparse.ArgumentParser()
    add_goodput_arguments(parser)
    trace, duration = load_trace(parser.parse_args(["--trace", str(path)]))
    assert [r.phase for r in trace] == ["a", "b"] and duration == 2.0


def test_a_shape_without_a_rate_arrives_near_the_fleet_capacity() -> None:
    parser = argparse.ArgumentParser()
    add_goodput_arguments(parser)
    args = parser.parse_args(["--trace", "prefill-heavy", "--duration", "100", "--engines", "4"])
    trace, _ = load_trace(args)
    costs = profile_options("llama-3.1-8b-h100").step_costs
    expected = 100 * suggested_rate(costs, 4, PREFILL_HEAVY)
    assert 0.8 * expected < len(trace) < 1.2 * expected

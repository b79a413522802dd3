"""Trace shapes are deterministic, shaped as documented, and round-trip through JSONL."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.tools.goodput.traces import (
    DECODE_HEAVY,
    PREFILL_HEAVY,
    SHAPES,
    TraceRequest,
    generate,
    parse_jsonl,
    phase_durations,
    to_jsonl,
)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_seed_fixes_the_trace(shape: str) -> None:
    first = generate(shape, seed=7, duration_s=60, rate=5)
    assert first == generate(shape, seed=7, duration_s=60, rate=5)
    assert first != generate(shape, seed=8, duration_s=60, rate=5)
    assert all(0 <= r.arrival_s < 60 for r in first)
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first)


def test_the_heavy_shapes_draw_from_their_ranges() -> None:
    for request in generate("prefill-heavy", seed=1, duration_s=100, rate=3):
        assert 2000 <= request.prompt_tokens <= 4000 and 50 <= request.output_tokens <= 100
    for request in generate("decode-heavy", seed=1, duration_s=100, rate=3):
        assert 150 <= request.prompt_tokens <= 250 and 500 <= request.output_tokens <= 1000


def test_shifting_alternates_its_phases_in_equal_windows() -> None:
    trace = generate("shifting", seed=3, duration_s=80, rate=4, cycles=2)
    windows = [(r.arrival_s // 20, r.phase) for r in trace]
    assert {phase for window, phase in windows if window in (0, 2)} == {"prefill-heavy"}
    assert {phase for window, phase in windows if window in (1, 3)} == {"decode-heavy"}
    assert phase_durations(trace, 80) == pytest.approx(
        {"prefill-heavy": 40, "decode-heavy": 40}, abs=2
    )


def test_bursty_crowds_arrivals_into_bursts() -> None:
    trace = generate("bursty", seed=5, duration_s=600, rate=2)
    bursts = sum(r.phase == "burst" for r in trace)
    lulls = sum(r.phase == "lull" for r in trace)
    # A third of the time at 2.5x, two thirds at 0.25x: ~5x the arrivals in bursts.
    assert bursts > 3 * lulls
    assert 0.8 * 1200 < len(trace) < 1.2 * 1200


def test_a_rate_can_depend_on_the_phase_mix() -> None:
    def rate(mix: object) -> float:
        return 10.0 if mix == DECODE_HEAVY else 1.0

    trace = generate("shifting", seed=2, duration_s=200, rate=rate, cycles=1)
    heavy = [r for r in trace if r.phase == "decode-heavy"]
    assert len(heavy) > 5 * (len(trace) - len(heavy))
    assert PREFILL_HEAVY.mean_prompt == 3000


def test_token_scale_shrinks_every_length_but_keeps_at_least_one() -> None:
    for request in generate("decode-heavy", seed=1, duration_s=10, rate=5, token_scale=0.001):
        assert request.prompt_tokens >= 1 and request.output_tokens >= 1


@given(
    st.lists(
        st.builds(
            TraceRequest,
            st.floats(0, 1e6),
            st.integers(1, 10**6),
            st.integers(1, 10**6),
            st.sampled_from(["all", "a", "b"]),
        ),
        max_size=20,
    )
)
def test_jsonl_round_trips(requests: list[TraceRequest]) -> None:
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    assert parse_jsonl(to_jsonl(ordered)) == ordered


def test_jsonl_phase_is_optional_and_bad_lines_are_named() -> None:
    text = '{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 5}\n\n'
    assert parse_jsonl(text) == [TraceRequest(1.0, 10, 5, "all")]
    with pytest.raises(ValueError, match="line 2"):
        parse_jsonl(text.strip() + '\n{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 5}')
    with pytest.raises(ValueError, match="line 1"):
        parse_jsonl("not json")
    with pytest.raises(ValueError, match="line 1"):
        parse_jsonl('{"arrival_s": true, "prompt_tokens": 1, "output_tokens": 1}')


def test_unknown_shapes_and_empty_durations_are_refused() -> None:
    with pytest.raises(ValueError, match="shapes"):
        generate("sideways", seed=0, duration_s=10, rate=1)
    with pytest.raises(ValueError):
        generate("bursty", seed=0, duration_s=0, rate=1)


def test_a_requests_tenant_round_trips_through_jsonl_and_is_optional() -> None:
    requests = [TraceRequest(0.5, 10, 2, "all", tenant="batch"), TraceRequest(1.0, 5, 1)]
    text = to_jsonl(requests)
    assert '"tenant":"batch"' in text and text.count("tenant") == 1
    assert parse_jsonl(text) == requests

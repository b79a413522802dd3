"""The token bucket: capacity = the limit, refilled at limit/60 a second, starting full."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.tenants.buckets import UNUSED, Bucket, Rate, duration_text, retry_after


def test_a_bucket_starts_full_and_takes_all_or_nothing() -> None:
    rate = Rate(60)
    bucket = rate.full(100.0)
    taken = rate.take(bucket, 59, 100.0)
    assert taken == Bucket(1.0, 100.0)
    assert rate.take(taken, 2, 100.0) is None
    assert rate.take(taken, 1, 100.0) == Bucket(0.0, 100.0)


def test_it_refills_continuously_at_a_sixtieth_of_the_limit_a_second() -> None:
    rate = Rate(120)  # 2 a second
    empty = Bucket(0.0, 10.0)
    assert rate.refill(empty, 10.5).level == pytest.approx(1.0)
    assert rate.refill(empty, 13.0).level == pytest.approx(6.0)
    assert rate.refill(empty, 1000.0).level == 120.0  # never above capacity


def test_a_clock_behind_the_stamp_refills_nothing_and_keeps_the_stamp() -> None:
    rate = Rate(60)
    bucket = Bucket(5.0, 50.0)
    assert rate.refill(bucket, 49.0) == bucket
    assert rate.take(bucket, 5, 49.0) == Bucket(0.0, 50.0)


def test_an_unused_bucket_is_full_whatever_its_capacity() -> None:
    assert Rate(7).refill(UNUSED, 3.0) == Bucket(7.0, 3.0)
    assert Rate(7).take(UNUSED, 7, 3.0) == Bucket(0.0, 3.0)


def test_a_lowered_capacity_clips_the_level() -> None:
    assert Rate(10).refill(Bucket(100.0, 5.0), 5.0).level == 10.0


def test_settle_gives_back_up_to_capacity_and_may_charge_below_zero() -> None:
    rate = Rate(100)
    assert rate.settle(Bucket(90.0, 0.0), 50, 0.0).level == 100.0
    debt = rate.settle(Bucket(10.0, 0.0), -30, 0.0)
    assert debt.level == -20.0
    # A debt is paid by the refill before anything can be taken again.
    assert rate.take(debt, 0, 0.0) is None
    assert rate.wait_s(debt, 1, 0.0) == pytest.approx(21 / (100 / 60))


def test_wait_is_zero_when_held_the_refill_time_otherwise_and_inf_when_never() -> None:
    rate = Rate(60)  # 1 a second
    bucket = Bucket(2.0, 0.0)
    assert rate.wait_s(bucket, 2, 0.0) == 0.0
    assert rate.wait_s(bucket, 5, 0.0) == pytest.approx(3.0)
    assert rate.wait_s(bucket, 5, 1.0) == pytest.approx(2.0)
    assert not rate.fits(61)
    assert rate.fits(60)
    assert rate.wait_s(bucket, 61, 0.0) == math.inf


def test_full_in_is_the_time_until_the_bucket_is_full() -> None:
    rate = Rate(600)  # 10 a second
    assert rate.full_in_s(Bucket(600.0, 0.0), 0.0) == 0.0
    assert rate.full_in_s(Bucket(0.0, 0.0), 0.0) == pytest.approx(60.0)
    assert rate.full_in_s(Bucket(590.0, 0.0), 0.5) == pytest.approx(0.5)


@pytest.mark.parametrize("per_minute", [0, -1, math.inf, math.nan])
def test_a_rate_is_a_finite_positive_number(per_minute: float) -> None:
    with pytest.raises(ValueError):
        Rate(per_minute)


@pytest.mark.parametrize(
    ("wait", "after"), [(0.0, 1), (0.2, 1), (1.0, 1), (1.01, 2), (2.9, 3), (59.5, 60)]
)
def test_retry_after_is_whole_seconds_rounded_up_at_least_one(wait: float, after: int) -> None:
    assert retry_after(wait) == after


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.0004, "0s"),
        (0.012, "12ms"),
        (0.02, "20ms"),
        (0.9994, "999ms"),
        (0.9996, "1s"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (17.28, "17.28s"),
        (60.0, "1m0s"),
        (90.0, "1m30s"),
        (360.0, "6m0s"),
        (67.2, "1m7.2s"),
        (3600.0, "1h0m0s"),
        (3725.5, "1h2m5.5s"),
    ],
)
def test_durations_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


@given(
    st.floats(1, 1e6),
    st.floats(-1e6, 1e6),
    st.floats(0, 1e4),
    st.lists(st.tuples(st.floats(0, 100), st.floats(0, 1e4)), max_size=20),
)
def test_the_level_never_exceeds_capacity_and_taking_never_goes_below_zero(
    per_minute: float, level: float, start: float, steps: list[tuple[float, float]]
) -> None:
    rate = Rate(per_minute)
    bucket = Bucket(level, start)
    now = start
    for elapsed, n in steps:
        now += elapsed
        before = rate.refill(bucket, now)
        taken = rate.take(bucket, n, now)
        if taken is None:
            assert before.level < n
            assert rate.wait_s(bucket, n, now) > 0
        else:
            assert taken.level >= 0 or n <= 0
            assert taken.level == pytest.approx(before.level - n)
            bucket = taken
        assert rate.refill(bucket, now).level <= rate.capacity


@given(st.floats(1, 1e5), st.floats(0, 1), st.floats(0, 1))
def test_after_waiting_wait_s_the_bucket_holds_n(
    per_minute: float, fill: float, want: float
) -> None:
    rate = Rate(per_minute)
    bucket = Bucket(fill * per_minute, 0.0)
    n = want * per_minute
    wait = rate.wait_s(bucket, n, 0.0)
    assert rate.refill(bucket, wait).level >= n - 1e-9 * per_minute

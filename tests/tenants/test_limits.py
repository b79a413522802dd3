"""A tenant's admission against its limits: what is taken, what is refused and how, what is
given back, and the headers that show it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from narwhal.config.tenants import TenantConfig
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.tenants.limits import (
    NEVER_RETRY_AFTER_S,
    Limit,
    RateLimited,
    TenantLimits,
    Ticket,
)
from narwhal.tenants.store import LocalStore, Row, SharedStore, limits_path

T = TypeVar("T")
NOW = 1000.0


class Spy:
    """A LocalStore that counts its visits."""

    def __init__(self) -> None:
        self.inner = LocalStore()
        self.visits = 0

    @property
    def worker(self) -> int:
        return 0

    def slot(self, name: str) -> int:
        self.visits += 1
        return self.inner.slot(name)

    def apply(self, slot: int, change: Callable[[Row], T]) -> T:
        self.visits += 1
        return self.inner.apply(slot, change)

    def read(self, slot: int) -> Row:
        self.visits += 1
        return self.inner.read(slot)

    def reset_worker(self, worker: int) -> None:
        self.inner.reset_worker(worker)

    def close(self) -> None:
        pass


def tenant(name: str = "batch", **limits: Any) -> TenantConfig:
    return TenantConfig(name=name, **limits)


def limits_of(*configs: TenantConfig, share: int = 1) -> TenantLimits:
    return TenantLimits(configs, LocalStore(), share)


def refusal(limits: TenantLimits, name: str, tokens: int, now: float) -> RateLimited:
    with pytest.raises(RateLimited) as raised:
        limits.admit(name, tokens, now)
    return raised.value


def test_a_tenant_without_limits_never_touches_the_store() -> None:
    spy = Spy()
    limits = TenantLimits([tenant("free", weight=3.0, priority=-1)], spy)
    tickets = [limits.admit("free", 10**9, NOW) for _ in range(1000)]
    for ticket in tickets:
        limits.settle(ticket, 5, NOW)
        limits.release(ticket, NOW + 1)
    assert limits.headers("free", NOW) == {}
    assert spy.visits == 0
    assert limits.state(NOW)["free"]["in_flight_here"] == 0


def test_a_tenant_the_configuration_does_not_name_has_no_limits() -> None:
    limits = limits_of(tenant(requests_per_minute=1))
    for _ in range(5):
        limits.release(limits.admit("nobody", 100, NOW), NOW)
    assert limits.headers("nobody", NOW) == {}


def test_requests_per_minute_refuses_with_429_and_the_refill_time() -> None:
    limits = limits_of(tenant(requests_per_minute=3))  # one every 20 s
    for _ in range(3):
        limits.admit("batch", 0, NOW)
    error = refusal(limits, "batch", 0, NOW)
    assert isinstance(error, NarwhalError)
    assert error.status == 429
    assert error.cause is Cause.UNAVAILABLE
    assert error.code == "rate_limit_exceeded"
    assert error.body()["error"]["code"] == "rate_limit_exceeded"
    assert error.limit is Limit.REQUESTS_PER_MINUTE
    assert error.retry_after == 20
    assert error.headers() == {"Retry-After": "20"}
    assert error.message == "tenant `batch` is over its requests_per_minute (3): retry in 20 s"
    # Partly refilled: the rest of the wait, rounded up.
    assert refusal(limits, "batch", 0, NOW + 12.5).retry_after == 8
    # A client that honours Retry-After is admitted when it comes back.
    limits.admit("batch", 0, NOW + 20)


def test_retry_after_is_at_least_one_second() -> None:
    limits = limits_of(tenant(requests_per_minute=6000))  # 100 a second
    for _ in range(6000):
        limits.admit("batch", 0, NOW)
    assert refusal(limits, "batch", 0, NOW).retry_after == 1


def test_tokens_per_minute_takes_the_requests_tokens() -> None:
    limits = limits_of(tenant(tokens_per_minute=600))  # 10 a second
    limits.admit("batch", 550, NOW)
    error = refusal(limits, "batch", 100, NOW)
    assert error.limit is Limit.TOKENS_PER_MINUTE
    assert error.retry_after == 5  # 50 more tokens at 10 a second
    assert error.message == (
        "tenant `batch` is over its tokens_per_minute (600) for this request's 100 tokens: "
        "retry in 5 s"
    )
    limits.admit("batch", 100, NOW + 5)


def test_a_refusal_takes_nothing_from_any_limit() -> None:
    limits = limits_of(tenant(max_concurrent=5, requests_per_minute=60, tokens_per_minute=100))
    limits.admit("batch", 90, NOW)
    before = limits.state(NOW)["batch"]
    assert refusal(limits, "batch", 20, NOW).limit is Limit.TOKENS_PER_MINUTE
    after = limits.state(NOW)["batch"]
    assert after["requests_level"] == before["requests_level"] == 59
    assert after["in_flight"] == before["in_flight"] == 1
    assert after["in_flight_here"] == 1


def test_the_checks_run_in_order_concurrency_requests_tokens() -> None:
    # Each tenant has used up every limit from a given one on.
    limits = limits_of(
        tenant("c", max_concurrent=1, requests_per_minute=1, tokens_per_minute=10),
        tenant("r", max_concurrent=2, requests_per_minute=1, tokens_per_minute=10),
        tenant("t", max_concurrent=2, requests_per_minute=2, tokens_per_minute=10),
    )
    for name in "crt":
        limits.admit(name, 10, NOW)
    assert refusal(limits, "c", 10, NOW).limit is Limit.MAX_CONCURRENT
    assert refusal(limits, "r", 10, NOW).limit is Limit.REQUESTS_PER_MINUTE
    assert refusal(limits, "t", 10, NOW).limit is Limit.TOKENS_PER_MINUTE


def test_a_request_larger_than_the_whole_bucket_is_refused_outright() -> None:
    spy = Spy()
    limits = TenantLimits([tenant(tokens_per_minute=1000, requests_per_minute=10)], spy)
    visits = spy.visits
    error = refusal(limits, "batch", 1001, NOW)
    assert error.status == 429
    assert error.limit is Limit.TOO_LARGE
    assert error.retry_after == NEVER_RETRY_AFTER_S == 60
    assert "can never be admitted" in error.message
    assert "tokens_per_minute (1000)" in error.message
    assert spy.visits == visits  # nothing taken: the store was not even visited
    limits.admit("batch", 1000, NOW)  # the whole bucket is allowed


def test_max_concurrent_counts_requests_until_released() -> None:
    limits = limits_of(tenant(max_concurrent=2))
    first = limits.admit("batch", 0, NOW)
    limits.admit("batch", 0, NOW)
    error = refusal(limits, "batch", 0, NOW)
    assert error.limit is Limit.MAX_CONCURRENT
    assert error.retry_after == 1  # no duration known yet
    assert error.message == (
        "tenant `batch` has its max_concurrent (2) requests in flight: retry in 1 s"
    )
    limits.release(first, NOW + 4.2)
    third = limits.admit("batch", 0, NOW + 4.2)
    # Retry-After from the tenant's recent mean duration: (4.2 + 8.0) / 2, rounded up.
    limits.release(third, NOW + 5, 8.0)
    limits.admit("batch", 0, NOW + 5)
    assert refusal(limits, "batch", 0, NOW + 5).retry_after == 7


def test_release_is_once_only() -> None:
    limits = limits_of(tenant(max_concurrent=2))
    first = limits.admit("batch", 0, NOW)
    limits.admit("batch", 0, NOW)
    limits.release(first, NOW)
    limits.release(first, NOW)
    limits.admit("batch", 0, NOW)
    assert refusal(limits, "batch", 0, NOW).limit is Limit.MAX_CONCURRENT
    assert limits.state(NOW)["batch"]["in_flight"] == 2


def test_settle_corrects_the_reservation_once() -> None:
    limits = limits_of(tenant(tokens_per_minute=1000))
    ticket = limits.admit("batch", 400, NOW)
    assert limits.state(NOW)["batch"]["tokens_level"] == 600
    limits.settle(ticket, 150, NOW)
    assert limits.state(NOW)["batch"]["tokens_level"] == 850
    limits.settle(ticket, 0, NOW)
    assert limits.state(NOW)["batch"]["tokens_level"] == 850


def test_settling_more_than_reserved_charges_the_difference() -> None:
    limits = limits_of(tenant(tokens_per_minute=600))  # 10 a second
    ticket = limits.admit("batch", 500, NOW)
    limits.settle(ticket, 700, NOW)
    assert limits.state(NOW)["batch"]["tokens_level"] == -100
    assert limits.headers("batch", NOW)["x-ratelimit-remaining-tokens"] == "0"
    # The debt is paid before the next 10 tokens: 11 s.
    assert refusal(limits, "batch", 10, NOW).retry_after == 11


def test_a_settle_never_fills_the_bucket_past_capacity() -> None:
    limits = limits_of(tenant(tokens_per_minute=100))
    ticket = limits.admit("batch", 10, NOW)
    limits.settle(ticket, 0, NOW + 60)
    assert limits.state(NOW + 60)["batch"]["tokens_level"] == 100


def test_headers_show_limit_remaining_and_reset_as_openai_does() -> None:
    limits = limits_of(tenant(requests_per_minute=60, tokens_per_minute=150000))
    limits.admit("batch", 16, NOW)
    assert limits.headers("batch", NOW) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149984",
        "x-ratelimit-reset-tokens": "6ms",
    }
    later = limits.headers("batch", NOW + 0.5)
    assert later["x-ratelimit-remaining-requests"] == "59"  # 59.5: whole requests only
    assert later["x-ratelimit-reset-requests"] == "500ms"
    assert limits.headers("batch", NOW + 10)["x-ratelimit-reset-requests"] == "0s"


def test_headers_name_only_the_limits_a_tenant_has() -> None:
    limits = limits_of(
        tenant("r", requests_per_minute=10),
        tenant("t", tokens_per_minute=10),
        tenant("c", max_concurrent=3),
    )
    assert set(limits.headers("r", NOW)) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }
    assert set(limits.headers("t", NOW)) == {
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }
    assert limits.headers("c", NOW) == {}


def test_an_emptied_bucket_resets_in_a_minute() -> None:
    limits = limits_of(tenant(requests_per_minute=2))
    limits.admit("batch", 0, NOW)
    limits.admit("batch", 0, NOW)
    refusal(limits, "batch", 0, NOW)
    headers = limits.headers("batch", NOW)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "1m0s"


def test_the_headers_of_an_admissions_instant_cost_no_second_visit() -> None:
    spy = Spy()
    limits = TenantLimits([tenant(requests_per_minute=60)], spy)
    limits.admit("batch", 0, NOW)
    visits = spy.visits
    assert limits.headers("batch", NOW)["x-ratelimit-remaining-requests"] == "59"
    assert spy.visits == visits
    refusal_limits = TenantLimits([tenant(requests_per_minute=1)], spy)
    refusal_limits.admit("batch", 0, NOW)  # the same row: already empty
    visits = spy.visits
    refusal(refusal_limits, "batch", 0, NOW)
    assert refusal_limits.headers("batch", NOW)["x-ratelimit-remaining-requests"] == "0"
    assert spy.visits == visits + 1  # the refused admission's one visit
    # Another instant: read afresh.
    assert limits.headers("batch", NOW + 30)["x-ratelimit-remaining-requests"] == "30"
    assert spy.visits == visits + 2


def test_each_replica_takes_its_share() -> None:
    limits = limits_of(
        tenant(max_concurrent=5, requests_per_minute=60, tokens_per_minute=1000), share=2
    )
    headers = limits.headers("batch", NOW)
    assert headers["x-ratelimit-limit-requests"] == "30"
    assert headers["x-ratelimit-limit-tokens"] == "500"
    error = refusal(limits, "batch", 501, NOW)
    assert error.limit is Limit.TOO_LARGE
    assert "1000, 500 on each of 2 replicas" in error.message
    limits.admit("batch", 0, NOW)
    limits.admit("batch", 0, NOW)
    assert refusal(limits, "batch", 0, NOW).limit is Limit.MAX_CONCURRENT  # floor(5 / 2)
    state = limits.state(NOW)["batch"]
    assert state["share"] == {
        "max_concurrent": 2,
        "requests_per_minute": 30,
        "tokens_per_minute": 500,
    }
    assert state["limits"]["requests_per_minute"] == 60


def test_a_concurrency_cap_below_the_replicas_still_admits_one() -> None:
    limits = limits_of(tenant(max_concurrent=1), share=3)
    limits.admit("batch", 0, NOW)
    assert refusal(limits, "batch", 0, NOW).limit is Limit.MAX_CONCURRENT


def test_a_share_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        limits_of(share=0)


def test_update_clips_a_lowered_capacity_and_keeps_the_level_of_a_raised_one() -> None:
    limits = limits_of(tenant(requests_per_minute=100))
    for _ in range(40):
        limits.admit("batch", 0, NOW)
    limits.update([tenant(requests_per_minute=30)])
    assert limits.state(NOW)["batch"]["requests_level"] == 30
    limits.update([tenant(requests_per_minute=1000)])
    assert limits.state(NOW)["batch"]["requests_level"] == 30
    assert limits.headers("batch", NOW)["x-ratelimit-limit-requests"] == "1000"


def test_update_given_the_clock_refills_at_the_old_rate_first() -> None:
    limits = limits_of(tenant(requests_per_minute=60))  # 1 a second
    for _ in range(60):
        limits.admit("batch", 0, NOW)
    limits.update([tenant(requests_per_minute=6000)], NOW + 10)
    # 10 s at the old rate (10), then 1 s at the new one (100).
    assert limits.state(NOW + 11)["batch"]["requests_level"] == pytest.approx(110)


def test_update_adds_tenants_full_and_removes_them() -> None:
    limits = limits_of(tenant("a", requests_per_minute=1))
    ticket = limits.admit("a", 0, NOW)
    limits.update([tenant("b", requests_per_minute=2)])
    # b is new: full.
    limits.admit("b", 0, NOW)
    limits.admit("b", 0, NOW)
    refusal(limits, "b", 0, NOW)
    # a is gone: no limits, and its old ticket still ends cleanly.
    for _ in range(3):
        limits.admit("a", 0, NOW)
    limits.settle(ticket, 5, NOW)
    limits.release(ticket, NOW)
    assert set(limits.state(NOW)) == {"b"}


def test_a_new_limit_of_a_known_tenant_starts_full() -> None:
    limits = limits_of(tenant(requests_per_minute=10))
    limits.admit("batch", 0, NOW)
    limits.update([tenant(requests_per_minute=10, tokens_per_minute=50)])
    assert limits.headers("batch", NOW)["x-ratelimit-remaining-tokens"] == "50"


def test_a_limit_lifted_mid_request_leaves_its_ticket_harmless() -> None:
    limits = limits_of(tenant(max_concurrent=1, tokens_per_minute=100))
    ticket = limits.admit("batch", 50, NOW)
    limits.update([tenant()])  # no limits now
    limits.settle(ticket, 0, NOW)
    limits.release(ticket, NOW)
    limits.update([tenant(max_concurrent=1, tokens_per_minute=100)])
    limits.admit("batch", 50, NOW)  # its place was given back
    assert limits.state(NOW)["batch"]["tokens_level"] == 0


def test_a_ticket_admitted_before_a_limit_existed_neither_settles_nor_releases_it() -> None:
    limits = limits_of(tenant())
    ticket = limits.admit("batch", 50, NOW)
    limits.update([tenant(max_concurrent=1, tokens_per_minute=100)])
    limits.admit("batch", 10, NOW)
    limits.settle(ticket, 0, NOW)  # reserved nothing: gives nothing back
    limits.release(ticket, NOW)  # held no place: frees none
    assert limits.state(NOW)["batch"]["tokens_level"] == 90
    assert refusal(limits, "batch", 0, NOW).limit is Limit.MAX_CONCURRENT


def test_a_ticket_that_reserved_no_tokens_settles_none() -> None:
    limits = limits_of(tenant(requests_per_minute=10))
    ticket = limits.admit("batch", 50, NOW)
    limits.update([tenant(requests_per_minute=10, tokens_per_minute=100)])
    limits.admit("batch", 10, NOW)
    limits.settle(ticket, 0, NOW)
    assert limits.state(NOW)["batch"]["tokens_level"] == 90


def test_a_refusals_headers_show_the_bucket_as_the_refusal_found_it() -> None:
    store = LocalStore()
    here, elsewhere = (TenantLimits([tenant(requests_per_minute=2)], store) for _ in "ab")
    here.admit("batch", 0, NOW)
    elsewhere.admit("batch", 0, NOW)  # another worker takes the last one meanwhile
    refusal(here, "batch", 0, NOW)
    assert here.headers("batch", NOW)["x-ratelimit-remaining-requests"] == "0"


def test_state_shows_limits_counts_and_levels() -> None:
    limits = limits_of(
        tenant("a", max_concurrent=4, requests_per_minute=60, tokens_per_minute=1000),
        tenant("free"),
    )
    ticket = limits.admit("a", 100, NOW)
    limits.admit("free", 5, NOW)
    limits.release(ticket, NOW + 2)
    limits.admit("a", 100, NOW + 2)
    state = limits.state(NOW + 2)
    assert state["a"] == {
        "limits": {"max_concurrent": 4, "requests_per_minute": 60, "tokens_per_minute": 1000},
        "share": {"max_concurrent": 4, "requests_per_minute": 60, "tokens_per_minute": 1000},
        "in_flight": 1,
        "in_flight_here": 1,
        "requests_level": pytest.approx(59.0),
        "tokens_level": pytest.approx(833.333, abs=1e-3),
        "mean_duration_s": 2.0,
    }
    assert state["free"]["in_flight"] is None
    assert state["free"]["in_flight_here"] == 1
    assert state["free"]["requests_level"] is None


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[tuple[SharedStore, SharedStore]]:
    path = limits_path(tmp_path)
    stores = SharedStore(path, 2, 0), SharedStore(path, 2, 1)
    yield stores
    for store in stores:
        store.close()


def test_workers_over_a_shared_store_enforce_one_limit(
    shared: tuple[SharedStore, SharedStore],
) -> None:
    config = tenant(max_concurrent=3, requests_per_minute=4)
    zero, one = (TenantLimits([config], store) for store in shared)
    tickets: list[Ticket] = [zero.admit("batch", 0, NOW), one.admit("batch", 0, NOW)]
    tickets.append(zero.admit("batch", 0, NOW))
    assert refusal(one, "batch", 0, NOW).limit is Limit.MAX_CONCURRENT
    zero.release(tickets[0], NOW)  # a ticket ends in the process that took it
    assert one.state(NOW)["batch"]["in_flight"] == 2  # one in each worker
    one.admit("batch", 0, NOW)
    zero.release(tickets[1], NOW)
    assert refusal(zero, "batch", 0, NOW).limit is Limit.REQUESTS_PER_MINUTE
    assert one.headers("batch", NOW)["x-ratelimit-remaining-requests"] == "0"


def test_a_dead_workers_places_are_given_back(
    shared: tuple[SharedStore, SharedStore],
) -> None:
    config = tenant(max_concurrent=2)
    zero, one = (TenantLimits([config], store) for store in shared)
    one.admit("batch", 0, NOW)
    one.admit("batch", 0, NOW)
    assert refusal(zero, "batch", 0, NOW).limit is Limit.MAX_CONCURRENT
    shared[0].reset_worker(1)
    zero.admit("batch", 0, NOW)

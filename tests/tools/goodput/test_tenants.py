"""A `--tenant` flag reads into a tenant's settings and load, and its records into figures."""

from __future__ import annotations

import random

import pytest

from narwhal.tools.goodput.score import Outcome, Slo
from narwhal.tools.goodput.tenants import (
    Record,
    TenantLoad,
    arrival_times,
    check_tenants,
    format_stats,
    outcome_record,
    parse_tenant,
    tenant_stats,
    with_defaults,
)


def test_a_flag_sets_the_tenants_settings_and_its_load() -> None:
    tenant = parse_tenant(
        "batch:priority=1,weight=2.5,requests_per_minute=600,rate=40,arrivals=fixed,"
        "max_tokens=32,retry_after=yes,start_s=2"
    )
    assert tenant.name == "batch"
    assert tenant.key == "sk-batch"
    assert tenant.settings == (("priority", 1), ("weight", 2.5), ("requests_per_minute", 600.0))
    assert (tenant.rate, tenant.arrivals, tenant.max_tokens) == (40.0, "fixed", 32)
    assert tenant.retry_after and tenant.open_loop and tenant.start_s == 2.0
    assert tenant.tenant_table() == {
        "name": "batch",
        "api_keys": ["sk-batch"],
        "priority": 1,
        "weight": 2.5,
        "requests_per_minute": 600.0,
    }


def test_a_closed_loop_tenant_with_its_own_key() -> None:
    tenant = parse_tenant("chat:concurrency=8,key=secret-1")
    assert tenant.concurrency == 8 and not tenant.open_loop
    assert tenant.key == "secret-1"
    assert tenant.tenant_table() == {"name": "chat", "api_keys": ["secret-1"]}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "NAME"),
        ("-bad:rate=1", "NAME"),
        ("a", "rate=R or concurrency=C"),
        ("a:rate=1,concurrency=2", "not both"),
        ("a:rate=0", "more than 0"),
        ("a:rate=1,priority=1.5", "integer"),
        ("a:rate=1,rate=2", "twice"),
        ("a:rate=1,colour=red", "unknown key"),
        ("a:rate=1,arrivals=bursty", "poisson or fixed"),
        ("a:rate", "KEY=VALUE"),
        ("a:rate=1,retry_after=maybe", "true or false"),
        ("a:rate=1,start_s=5,stop_s=2", "after start_s"),
    ],
)
def test_a_wrong_flag_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_tenant(text)


def test_a_spec_without_load_is_allowed_when_the_load_comes_from_elsewhere() -> None:
    tenant = parse_tenant("a:weight=2", load_required=False)
    assert tenant.rate is None and tenant.concurrency is None


def test_two_tenants_may_not_share_a_name_or_a_key() -> None:
    check_tenants([parse_tenant("a:rate=1"), parse_tenant("b:rate=1")])
    with pytest.raises(ValueError, match="name"):
        check_tenants([parse_tenant("a:rate=1"), parse_tenant("a:rate=2")])
    with pytest.raises(ValueError, match="key"):
        check_tenants([parse_tenant("a:rate=1,key=k"), parse_tenant("b:rate=1,key=k")])


def test_a_tenant_crosses_to_a_load_process_and_back_unchanged() -> None:
    tenant = parse_tenant("a:priority=2,concurrency=3,retry_after=true,stop_s=9")
    assert TenantLoad.from_json(tenant.to_json()) == tenant


def test_defaults_fill_only_what_the_spec_left_out() -> None:
    tenant = with_defaults(parse_tenant("a:rate=1,max_tokens=9"), prompt_tokens=100, max_tokens=64)
    assert (tenant.prompt_tokens, tenant.max_tokens) == (100, 9)


def test_fixed_arrivals_are_evenly_spaced_within_the_tenants_window() -> None:
    tenant = parse_tenant("a:rate=4,arrivals=fixed,start_s=1,stop_s=3")
    times = arrival_times(tenant, 10.0, random.Random(0))
    assert times == pytest.approx([1 + i / 4 for i in range(8)])


def test_poisson_arrivals_come_at_about_the_rate_and_a_seed_fixes_them() -> None:
    tenant = parse_tenant("a:rate=50")
    times = arrival_times(tenant, 20.0, random.Random(1))
    assert times == arrival_times(tenant, 20.0, random.Random(1))
    assert 900 <= len(times) <= 1100
    assert all(0 <= t < 20 for t in times) and times == sorted(times)
    assert arrival_times(parse_tenant("a:concurrency=1"), 20.0, random.Random(1)) == []


def test_a_record_crosses_to_the_harness_and_back_unchanged() -> None:
    record = Record("a", 1.5, 429, False, retry_after_s=2.0, returned=True, ended_s=1.6)
    assert Record.from_row(record.to_row()) == record
    assert record.refused and not record.admitted


SLO = Slo(ttft_s=0.5, tpot_s=0.05)


def _records() -> list[Record]:
    answered = [Record("a", t, 200, True, 0.1, 0.01, 100, 10, ended_s=t + 1) for t in range(8)]
    slow = Record("a", 8.0, 200, True, 0.9, 0.01, 100, 10, ended_s=9.0)
    cut = Record("a", 8.5, 200, False, 0.1, None, 100, 3, ended_s=9.0)
    return [
        *answered,
        slow,
        cut,
        Record("a", 2.0, 429, False, retry_after_s=1.0),
        Record("a", 3.0, 429, False, returned=True),
        Record("a", 3.5, 200, True, 0.1, 0.01, 100, 10, returned=True, ended_s=4.0),
        Record("a", 4.0, 503, False),
        Record("a", 4.5, 0, False),
        Record("b", 1.0, 200, True, 0.1, 0.01, 100, 10),
    ]


def test_a_tenants_figures_count_answers_refusals_goodput_tokens_and_returns() -> None:
    stats = tenant_stats("a", _records(), window=(0.0, 10.0), slo=SLO)
    assert stats.requests == 15
    assert stats.ok == 10  # 8 + the slow one + the return
    assert stats.refused == {429: 2, 503: 1}
    assert stats.failed == 2  # the cut stream and the one with no answer
    assert stats.good == 9 and stats.goodput_rps == pytest.approx(0.9)
    assert stats.tokens_served == 10 * 110
    assert (stats.returns, stats.admitted_on_return) == (2, 1)
    assert stats.ttft_p50_s == pytest.approx(0.1)
    assert "a" in format_stats([stats]) and "1/2" in format_stats([stats])


def test_the_window_is_by_send_time_or_by_end_time() -> None:
    by_send = tenant_stats("a", _records(), window=(0.0, 4.0))
    by_end = tenant_stats("a", _records(), window=(0.0, 4.0), by_end=True)
    assert by_send.ok == 5  # sent at 0..3, and the return sent at 3.5
    assert by_end.ok == 3  # ended at 1..3; the return, ending at 4.0, is out
    assert by_send.goodput_rps == pytest.approx(1.25)


def test_no_records_no_percentiles() -> None:
    stats = tenant_stats("nobody", _records(), window=(0.0, 10.0))
    assert stats.requests == 0 and stats.ttft_p99_s is None


def test_a_replayed_outcome_becomes_a_record() -> None:
    outcome = Outcome(
        "all", False, arrival_s=2.0, tenant="a", status=429, prompt_tokens=5, retry_after_s=1.0
    )
    record = outcome_record(outcome)
    assert (record.tenant, record.sent_s, record.status, record.ok) == ("a", 2.0, 429, False)
    assert record.retry_after_s == 1.0 and record.prompt_tokens == 5

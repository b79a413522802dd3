"""The tenants experiments' figures: capacity, what a bucket allows, admissions, the router's
journal, verdicts."""

from __future__ import annotations

import orjson
import pytest
from tenant_figures import (
    Waits,
    admitted,
    bucket_allows,
    capacity_rps,
    format_verdicts,
    journal_entries,
    next_release_wait,
    queue_waits,
    ratio,
    send_span,
    verdict,
)

from narwhal.tools.goodput.tenants import Record


def test_capacity_counts_answers_ending_in_the_window() -> None:
    records = [Record("a", 0.0, 200, True, ended_s=t) for t in (1.0, 2.0, 3.0, 4.5, 6.0)]
    records.append(Record("a", 0.0, 200, False, ended_s=3.0))
    assert capacity_rps(records, (2.0, 6.0)) == pytest.approx(3 / 4)


def test_a_bucket_allows_its_capacity_and_what_refills_over_the_span() -> None:
    assert bucket_allows(600, 0.0) == 600
    assert bucket_allows(600, 40.0) == pytest.approx(1000)
    assert bucket_allows(60_000, 30.0) == pytest.approx(90_000)


def test_admitted_requests_are_those_not_refused_by_a_limit() -> None:
    records = [
        Record("a", 1.0, 200, True),
        Record("a", 2.0, 429, False),
        Record("a", 3.0, 503, False),  # admitted by its limits, refused by the queue
        Record("a", 4.0, 0, False),  # never answered: no telling
        Record("b", 5.0, 200, True),
    ]
    assert [r.sent_s for r in admitted(records, "a")] == [1.0, 3.0]
    assert send_span(records, "a") == 3.0
    assert send_span(records, "nobody") == 0.0


def test_ratios_and_verdicts_say_n_a_when_a_figure_is_missing() -> None:
    assert ratio(3.0, 1.5) == 2.0
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None
    missing = verdict("x", "figure", None, "<= 2", False)
    assert missing.met is None and missing.value == "n/a"
    table = format_verdicts([missing, verdict("x", "other", 2.5, "<= 2", False)])
    assert "n/a" in table and "NO" in table and "2.500" in table


def test_queue_waits_by_tenant_come_from_the_routers_journal() -> None:
    def line(ts: float, tenant: str | None, wait: float | None, status: int = 200) -> bytes:
        entry = {"type": "request", "ts": ts, "queue_wait_s": wait, "status": status}
        entry["first_byte_s"] = None if wait is None else wait + 0.02
        if tenant is not None:
            entry["tenant"] = tenant
        return orjson.dumps(entry)

    lines = [
        line(100.0, "a", 9.0),  # within the first second: left out
        *(line(101.0 + i, "a", 0.01 * i) for i in range(1, 101)),
        line(102.0, "b", 0.5),
        line(102.0, "b", 0.7, status=429),  # refused: no seat waited for
        line(102.0, None, 0.2),  # a router journaling no tenant
        line(102.0, "b", None),
        b"not json",
        orjson.dumps({"type": "engine", "ts": 1.0}),
    ]
    entries = journal_entries(lines)
    assert len(entries) == 105
    waits = queue_waits(entries, after_s=1.0)
    assert set(waits) == {"a", "b"}
    a = waits["a"]
    assert a.requests == 100
    assert a.queue_p50_s == pytest.approx(0.505) and a.queue_p99_s == pytest.approx(0.9901)
    assert a.rest_p50_s == pytest.approx(0.02) and a.rest_p99_s == pytest.approx(0.02)
    b = waits["b"]
    assert (b.requests, b.queue_p50_s, b.queue_p99_s) == (1, 0.5, 0.5)
    assert isinstance(b, Waits) and b.rest_p99_s == pytest.approx(0.02)


def test_the_wait_for_the_next_release_grows_with_clumped_releases() -> None:
    # Evenly spaced releases 10 ms apart: a random moment waits uniformly 0..10 ms.
    even = [i * 0.01 for i in range(101)]
    assert next_release_wait(even, 0.5) == pytest.approx(0.005)
    assert next_release_wait(even, 0.99) == pytest.approx(0.0099)
    # The same number of releases in clumps of ten every 100 ms: the same mean gap, and a
    # random moment waits uniformly 0..100 ms.
    clumped = [0.1 * (i // 10) for i in range(101)]
    assert next_release_wait(clumped, 0.5) == pytest.approx(0.05)
    assert next_release_wait(clumped, 0.99) == pytest.approx(0.099)
    assert next_release_wait([1.0, 1.0], 0.5) is None

"""The last minutes of requests: with tenants, each tenant's outcomes and refusals."""

from __future__ import annotations

from typing import Any

from narwhal.observe.recent import RecentCalls
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call


def call(status: int = 200, **fields: Any) -> Call:
    done = Call("r1", None, Endpoint.COMPLETIONS, arrival=10.0, deadline=20.0, **fields)
    done.status = status
    return done


def test_requests_without_a_tenant_add_no_tenants_summary() -> None:
    recent = RecentCalls(window_s=60.0, bucket_s=10.0)
    recent.add(call(200), now=1000.0)
    recent.add(call(503, refusal="overload"), now=1001.0)
    assert "tenants" not in recent.summary(now=1005.0)


def test_each_tenants_outcomes_and_refusals_are_counted_within_the_window() -> None:
    recent = RecentCalls(window_s=60.0, bucket_s=10.0)
    recent.add(call(200, tenant="search"), now=1000.0)  # past the window by 1105
    for now in (1100.0, 1101.0, 1102.0):
        recent.add(call(200, tenant="search"), now=now)
    recent.add(call(429, tenant="search", refusal="requests_per_minute"), now=1103.0)
    recent.add(call(503, tenant="batch", refusal="shed"), now=1104.0)
    recent.add(call(502, tenant="batch"), now=1104.0)
    recent.add(call(200), now=1104.0)
    summary = recent.summary(now=1105.0)
    assert summary["tenants"] == {
        "batch": {"requests": 2, "outcomes": {"error": 2}, "refused": 1},
        "search": {"requests": 4, "outcomes": {"ok": 3, "client_error": 1}, "refused": 1},
    }
    # The router's own counts hold every request, with a tenant or without.
    assert summary["requests"] == 7
    assert "tenants" not in recent.summary(now=2000.0)

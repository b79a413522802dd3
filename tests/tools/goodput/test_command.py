"""`narwhal goodput --tenant`: each tenant's trace at its rate and shape, merged and keyed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from narwhal.tools.goodput.command import load_trace, tenant_trace
from narwhal.tools.goodput.score import ALL
from narwhal.tools.goodput.tenants import parse_tenant
from narwhal.tools.goodput.traces import TraceRequest, to_jsonl


def _args(**overrides: object) -> argparse.Namespace:
    fields: dict[str, object] = {
        "trace": "shifting",
        "duration": 20.0,
        "cycles": 1,
        "token_scale": 1.0,
        "seed": 3,
        "rate": None,
        "profile": "dev",
        "engines": 2,
        "tenant": [],
    }
    return argparse.Namespace(**(fields | overrides))


def test_each_tenant_gets_its_own_trace_at_its_rate_merged_in_arrival_order() -> None:
    tenants = [parse_tenant("a:rate=20"), parse_tenant("b:rate=2,max_tokens=7")]
    trace = tenant_trace(_args(), tenants)
    a = [r for r in trace if r.tenant == "a"]
    b = [r for r in trace if r.tenant == "b"]
    assert 300 <= len(a) <= 500 and 20 <= len(b) <= 60
    assert {r.output_tokens for r in b} == {7}
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    # One shape for all: the phases are kept.
    assert {r.phase for r in trace} == {"prefill-heavy", "decode-heavy"}
    assert tenant_trace(_args(), tenants) == trace


def test_tenants_of_different_shapes_are_read_as_one_phase() -> None:
    tenants = [parse_tenant("a:rate=5"), parse_tenant("b:rate=5,shape=decode-heavy")]
    assert {r.phase for r in tenant_trace(_args(), tenants)} == {ALL}


def test_a_tenant_without_a_rate_or_with_an_unknown_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="rate=R"):
        tenant_trace(_args(), [parse_tenant("a:concurrency=2")])
    with pytest.raises(ValueError, match="shape"):
        tenant_trace(_args(), [parse_tenant("a:rate=2,shape=short")])


def test_a_trace_file_may_name_tenants_that_flags_key(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(to_jsonl([TraceRequest(0.5, 10, 2, tenant="a"), TraceRequest(1, 3, 1)]))
    tenant = parse_tenant("a:weight=2", load_required=False)
    requests, duration = load_trace(_args(trace=str(path), tenant=[tenant]))
    assert [r.tenant for r in requests] == ["a", ""] and duration == 1.0
    with pytest.raises(ValueError, match="without a --tenant flag"):
        load_trace(_args(trace=str(path)))

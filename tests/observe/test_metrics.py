"""Request metrics come from the finished Call; engine metrics are read when scraped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.app.process import Router
from narwhal.config.root import parse_config
from narwhal.engines.gaps import TokenGaps
from narwhal.engines.handoff import DescriptorRejected
from narwhal.fleet.lifecycle import Event
from narwhal.observe.events import JsonFormatter, log_call
from narwhal.observe.recent import RecentCalls, percentiles
from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.descriptor import Defect
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.router.call import Call, Stage
from narwhal.runtime.ranks import nearest_rank


def router() -> Router:
    return Router(
        parse_config(
            {
                "model": "m",
                "engines": [
                    {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                    {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode"},
                ],
            },
            source="test",
        )
    )


def call(status: int = 200, **fields: Any) -> Call:
    done = Call("r1", None, Endpoint.COMPLETIONS, arrival=10.0, deadline=20.0, **fields)
    done.status = status
    return done


def samples(metrics_text: bytes) -> dict[str, float]:
    """Sample name plus sorted labels → value."""
    values = {}
    for family in text_string_to_metric_families(metrics_text.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def test_gaps_count_into_the_first_bucket_whose_bound_holds_them() -> None:
    gaps = TokenGaps((0.01, 0.1))
    for gap in (0.005, 0.01, 0.0100001, 0.5):
        gaps.add(gap)
    assert gaps.counts == [2, 1, 1]
    assert gaps.cumulative() == [("0.01", 2.0), ("0.1", 3.0), ("+Inf", 4.0)]
    assert gaps.count == 4 and gaps.total == pytest.approx(0.5250001)


def test_nearest_rank_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]
    assert nearest_rank(values, 50) == 50 and nearest_rank(values, 99) == 99
    assert nearest_rank([3.0], 99) == 3.0
    assert percentiles([]) is None
    assert percentiles([0.2, 0.1, 0.3]) == {"p50": 0.2, "p90": 0.3, "p99": 0.3}


def test_recent_calls_keep_only_the_window() -> None:
    recent = RecentCalls(window_s=60.0, bucket_s=10.0, max_samples=3)
    recent.add(call(200, ttft_s=0.5, first_byte_s=0.9), now=1000.0)
    for now in (1100.0, 1101.0, 1102.0, 1103.0):
        recent.add(call(200, ttft_s=0.1, first_byte_s=0.2), now=now)
    recent.add(call(502), now=1105.0)
    summary = recent.summary(now=1109.0)
    # The request at 1000 s is older than the window; only the last 3 latencies are kept.
    assert summary["requests"] == 5 and summary["outcomes"] == {"ok": 4, "error": 1}
    assert summary["rate_per_s"] == 0.5
    assert summary["ttft_s"] == {"p50": 0.1, "p90": 0.1, "p99": 0.1}
    assert summary["first_byte_s"] == {"p50": 0.2, "p90": 0.2, "p99": 0.2}
    series = summary["series"]
    assert [b["ago_s"] for b in series] == [50.0, 40.0, 30.0, 20.0, 10.0, 0.0]
    assert series[-1] == {"ago_s": 0.0, "ok": 4, "error": 1}
    assert recent.summary(now=2000.0)["requests"] == 0


def test_recent_calls_count_how_requests_were_served_within_the_window() -> None:
    recent = RecentCalls(window_s=60.0, bucket_s=10.0)
    recent.add(call(200, handoff="fallback"), now=1000.0)
    recent.add(call(200, handoff="crossed"), now=1100.0)
    recent.add(call(200, handoff="fallback"), now=1101.0)
    recent.add(call(400), now=1102.0)  # refused before placement: no handoff
    assert recent.summary(now=1105.0)["handoffs"] == {"crossed": 1, "fallback": 1}


async def test_entering_a_stage_counts_the_time_spent_in_the_one_before() -> None:
    now = asyncio.get_running_loop().time()
    timed = Call("r1", None, Endpoint.COMPLETIONS, arrival=now - 1.0, deadline=now + 10)
    timed.enter(Stage.QUEUED)
    assert timed.stage is Stage.QUEUED and timed.stage_at >= now
    assert timed.spent == {Stage.ADMISSION: pytest.approx(1.0, abs=0.05)}


def test_stage_times_add_up_over_attempts() -> None:
    timed = call()
    # (stage entered, at): a first attempt fails in prefill, the retry streams.
    for stage, at in (
        (Stage.QUEUED, 10.1),
        (Stage.PREFILL, 10.3),
        (Stage.QUEUED, 10.5),
        (Stage.PREFILL, 11.0),
        (Stage.DECODE, 11.2),
        (Stage.RELAY, 11.3),
    ):
        assert timed.decode_s is None
        timed.finish(at)
        timed.stage = stage
    timed.finish(13.3)
    assert timed.queue_wait_s == pytest.approx(0.2 + 0.5)
    assert timed.prefill_s == pytest.approx(0.2 + 0.2)
    assert timed.decode_s == pytest.approx(0.1 + 2.0)


def test_a_failure_is_recorded_once_however_it_reaches_the_call() -> None:
    failed = call()
    error = engine_error(Cause.SILENCE, "engine went silent", "d0")
    failed.errors.append(error)
    failed.fail(error)
    assert failed.errors == [error] and failed.status == 504 and failed.outcome == "timeout"
    assert failed.entry(11.0)["failures"] == [{"engine": "d0", "cause": "silence", "status": 504}]


async def test_one_finished_call_moves_its_request_metrics() -> None:
    the_router = router()
    done = call(
        502,
        ttft_s=0.2,
        first_byte_s=0.5,
        attempts=2,
        output_tokens=None,
        handoffs=["crossed", "recomputed"],
        model="m",
    )
    done.cause = "descriptor"
    done.errors = [
        DescriptorRejected(Defect.MISSING_ENGINE_ID, "p0"),
        NarwhalError(502, "boom", Cause.CLOSED_EARLY, engine="d0"),
    ]
    done.spent = {Stage.QUEUED: 0.01, Stage.PREFILL: 0.19, Stage.DECODE: 0.3}
    the_router.metrics.observe(done, now=11.5)
    body, content_type = the_router.metrics.render("text/plain")
    values = samples(body)

    assert content_type.startswith("text/plain")
    base = "adapter=,model=m"
    labels = f"{base},outcome=error,route=/v1/completions,status=502"
    assert values[f"narwhal_requests_total{{{labels}}}"] == 1
    errors = "adapter=,cause=descriptor,model=m,route=/v1/completions"
    assert values[f"narwhal_request_errors_total{{{errors}}}"] == 1
    assert values[f"narwhal_request_duration_seconds_sum{{{base}}}"] == 1.5
    assert values[f"narwhal_first_byte_after_ttft_seconds_sum{{{base}}}"] == pytest.approx(0.3)
    assert values[f"narwhal_queue_wait_seconds_sum{{{base}}}"] == 0.01
    assert values[f"narwhal_decode_seconds_sum{{{base}}}"] == 0.3
    assert values[f"narwhal_attempts_total{{{base}}}"] == 2
    assert values["narwhal_handoffs_total{kind=crossed}"] == 1
    assert values["narwhal_handoffs_total{kind=recomputed}"] == 1
    assert values["narwhal_descriptor_rejections_total{defect=missing_engine_id}"] == 1
    assert values[f"narwhal_output_tokens_total{{{base}}}"] == 0


async def test_request_series_are_labelled_by_model_and_adapter_and_made_once() -> None:
    the_router = router()
    # The pool's base-weights series exist before its first request.
    fresh = samples(the_router.metrics.render(None)[0])
    assert fresh["narwhal_ttft_seconds_count{adapter=,model=m}"] == 0
    assert fresh["narwhal_output_tokens_total{adapter=,model=m}"] == 0
    metrics = the_router.metrics
    for model, adapter, tokens in (
        ("m", None, 3),
        ("m", "sql", 5),
        ("m", "sql", 7),
        ("n", None, 1),
    ):
        metrics.observe(
            call(200, model=model, adapter=adapter, output_tokens=tokens, ttft_s=0.1), 11.0
        )
    # Refused before its model was known (a bad body, an unknown name): model "".
    metrics.observe(call(404), 11.0)
    values = samples(metrics.render(None)[0])
    ok = "outcome=ok,route=/v1/completions,status=200"
    assert values[f"narwhal_requests_total{{adapter=,model=m,{ok}}}"] == 1
    assert values[f"narwhal_requests_total{{adapter=sql,model=m,{ok}}}"] == 2
    assert values[f"narwhal_requests_total{{adapter=,model=n,{ok}}}"] == 1
    missing = "outcome=client_error,route=/v1/completions,status=404"
    assert values[f"narwhal_requests_total{{adapter=,model=,{missing}}}"] == 1
    assert values["narwhal_output_tokens_total{adapter=sql,model=m}"] == 12
    assert values["narwhal_ttft_seconds_count{adapter=sql,model=m}"] == 2
    assert values["narwhal_ttft_seconds_count{adapter=,model=n}"] == 1
    # Summed over the new labels, the series are what they were without them.
    total = sum(v for k, v in values.items() if k.startswith("narwhal_requests_total{"))
    assert total == 5
    # One kept set of series per pair: a second request finds the same children.
    assert metrics.series("m", "sql") is metrics.series("m", "sql")
    assert metrics.series("m", "sql").ttft is metrics.ttft.child("m", "sql")


async def test_engine_metrics_are_read_from_the_engines_when_scraped() -> None:
    the_router = router()
    d0 = the_router.fleet.by_id["d0"]
    d0.lifecycle.apply(Event.EJECT, lambda _: None)
    d0.streak, d0.ejections = 3, 1
    d0.failures["silence"] = 3
    d0.probes["failure"] = 2
    d0.decode_seats = 5
    d0.adapters = {"sql": None, "poet": None}
    values = samples(the_router.metrics.render(None)[0])
    # Every engine series names the engine's model.
    assert values["narwhal_engine_state{engine=d0,model=m,state=ejected}"] == 1
    assert values["narwhal_engine_state{engine=d0,model=m,state=admitted}"] == 0
    assert values["narwhal_engine_state{engine=p0,model=m,state=admitted}"] == 1
    assert values["narwhal_engine_streak{engine=d0,model=m}"] == 3
    assert values["narwhal_engine_ejections_total{engine=d0,model=m}"] == 1
    assert values["narwhal_engine_leg_failures_total{cause=silence,engine=d0,model=m}"] == 3
    assert values["narwhal_engine_leg_failures_total{cause=connect,engine=d0,model=m}"] == 0
    assert values["narwhal_engine_probes_total{engine=d0,model=m,result=failure}"] == 2
    assert values["narwhal_engine_probes_total{engine=d0,model=m,result=success}"] == 0
    assert values["narwhal_engine_seats_in_use{engine=d0,model=m,phase=decode}"] == 5
    assert values["narwhal_engine_adapters{engine=d0,model=m}"] == 2
    assert values["narwhal_engine_adapters{engine=p0,model=m}"] == 0
    # A decode-only engine has no prefill seats to show.
    assert "narwhal_engine_seats_in_use{engine=d0,model=m,phase=prefill}" not in values
    assert all(",model=m" in key for key in values if key.startswith("narwhal_engine_")), (
        "an engine series without its model"
    )


async def test_each_router_has_its_own_registry() -> None:
    first, second = router(), router()
    first.metrics.observe(call(200, model="m"), now=11.0)
    ok = "narwhal_requests_total{adapter=,model=m,outcome=ok,route=/v1/completions,status=200}"
    assert samples(first.metrics.render(None)[0])[ok] == 1
    assert ok not in samples(second.metrics.render(None)[0])


def test_a_client_error_log_line_leaves_out_the_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    failed = call()
    failed.fail(NarwhalError(400, "prompt 'whale secrets' is too long", Cause.BAD_REQUEST))
    log_call(failed, now=10.5)
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert "whale" not in record.getMessage()
    assert record.getMessage().endswith("failed with 400 (bad_request) after 0 attempts")


def test_json_log_lines_carry_the_event_fields() -> None:
    record = logging.LogRecord("narwhal.engine", logging.WARNING, "", 0, "engine %s", ("d0",), None)
    record.fields = {"engine": "d0", "event": "ejected"}
    line = orjson.loads(JsonFormatter().format(record))
    assert line["message"] == "engine d0" and line["level"] == "warning"
    assert line["engine"] == "d0" and line["event"] == "ejected"
    assert line["logger"] == "narwhal.engine"

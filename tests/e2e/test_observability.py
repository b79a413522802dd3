"""Metrics, journal lines and logs move as requests succeed and engines fail."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.commands.cli import main
from narwhal.observe.events import configure_logging
from support.stack import (
    CHAT,
    COMPLETION,
    Stack,
    StackFactory,
    arm,
    engine_state,
    hold_readmission,
    settled,
)

STREAM = {**COMPLETION, "stream": True}
TWO_PRODUCERS = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))


class Samples:
    """One scrape of `/metrics`, looked up by sample name and labels."""

    def __init__(self, text: str) -> None:
        self.values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.values[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        """The sample's value summed over the labels not named (as `sum by` the named ones
        would: the model and adapter the request series carry, say); 0 for a labelled
        series that has not appeared yet."""
        wanted = frozenset(labels.items())
        return sum(
            value
            for (sample, have), value in self.values.items()
            if sample == name and wanted <= have
        )

    def exactly(self, name: str, **labels: str) -> float | None:
        """The value of the one sample with exactly these labels, if it is there."""
        return self.values.get((name, frozenset(labels.items())))


async def scrape(stack: Stack) -> Samples:
    async with stack.http.get(stack.url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return Samples(await response.text())


async def test_successful_requests_move_request_latency_and_handoff_metrics(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        before = await scrape(stack)
        assert before("narwhal_requests_in_flight") == 0
        assert before("narwhal_inter_token_gap_seconds_count") == 0
        assert (await stack.post("/v1/completions", STREAM))[0] == 200
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        assert (await stack.post("/v1/chat/completions", CHAT))[0] == 200
        await settled(stack)
        after = await scrape(stack)

    ok = {"outcome": "ok", "status": "200"}
    assert after("narwhal_requests_total", route="/v1/completions", **ok) == 2
    assert after("narwhal_requests_total", route="/v1/chat/completions", **ok) == 1
    for histogram in (
        "narwhal_ttft_seconds",
        "narwhal_first_byte_seconds",
        "narwhal_first_byte_after_ttft_seconds",
        "narwhal_request_duration_seconds",
        "narwhal_queue_wait_seconds",
        "narwhal_prefill_seconds",
        "narwhal_decode_seconds",
    ):
        assert after(histogram + "_count") == 3, histogram
        assert after(histogram + "_bucket", le="+Inf") == 3, histogram
    assert 0 < after("narwhal_ttft_seconds_sum") < after("narwhal_first_byte_seconds_sum")
    assert after("narwhal_prefill_seconds_sum") > 0 and after("narwhal_decode_seconds_sum") > 0
    assert after("narwhal_attempts_total") == 3 and after("narwhal_retries_total") == 0
    assert after("narwhal_handoffs_total", kind="crossed") == 3
    assert after("narwhal_output_tokens_total") == 8 + 8 + 9
    # Seven of eight tokens in each completion arrive after the first one.
    assert after("narwhal_inter_token_gap_seconds_count") >= 3 * 7
    assert after("narwhal_inter_token_gap_seconds_sum") > 0
    assert after("narwhal_engine_state", engine="d0", state="admitted") == 1
    assert after("narwhal_engine_seats_in_use", engine="d0", phase="decode") == 0
    assert after("narwhal_engine_seats_limit", engine="p0", phase="prefill") == 64


async def test_engine_info_names_each_engine_with_its_role(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        samples = await scrape(stack)
        urls = {e.options.name: e.url for e in stack.fleet.engines}
    assert samples("narwhal_engine_info", engine="p0", role="prefill", url=urls["p0"]) == 1
    assert samples("narwhal_engine_info", engine="d0", role="decode", url=urls["d0"]) == 1


@pytest.mark.parametrize(
    ("engine", "fault", "cause", "status"),
    [
        ("p0", {"phase": "prefill", "status": 503}, "http_status", 502),
        ("p0", {"phase": "prefill", "hang_s": 2.0}, "prefill_timeout", 504),
        ("d0", {"phase": "decode", "hang_s": 2.0}, "first_token_timeout", 504),
        ("d0", {"phase": "decode", "silence_after": 2, "silence_s": 2.0}, "silence", 504),
        ("d0", {"phase": "decode", "close_after": 2}, "closed_early", 502),
        ("d0", {"phase": "decode", "error_after": 2, "error_code": 503}, "error_object", 503),
    ],
)
async def test_each_engine_failure_kind_is_counted_against_its_engine(
    make_stack: StackFactory, engine: str, fault: dict[str, Any], cause: str, status: int
) -> None:
    timeouts = {
        "prefill_timeout_s": 0.3,
        "first_token_timeout_s": 0.3,
        "decode_read_timeout_s": 0.3,
    }
    async with make_stack(engine=timeouts) as stack:
        arm(stack.engine(engine), times=1, **fault)
        got, _ = await stack.post("/v1/completions", STREAM)
        await settled(stack)
        samples = await scrape(stack)

    outcome = "timeout" if status == 504 else "error"
    route = "/v1/completions"
    # A stream that fails after its 200 still ends with the failure's status.
    assert got in (200, status)
    assert samples("narwhal_requests_total", route=route, outcome=outcome, status=str(status)) == 1
    assert samples("narwhal_request_errors_total", route=route, cause=cause) == 1
    assert samples("narwhal_engine_leg_failures_total", engine=engine, cause=cause) == 1
    assert samples("narwhal_engine_streak", engine=engine) == 1
    others = [c for c in ("http_status", "silence", "closed_early", "connect") if c != cause]
    for other in others:
        assert samples("narwhal_engine_leg_failures_total", engine=engine, cause=other) == 0


async def test_a_refused_connection_counts_as_connect(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        arm(stack.engine("d0"), phase="decode", refuse_s=5)
        for _ in range(2):
            assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        samples = await scrape(stack)
    assert samples("narwhal_engine_leg_failures_total", engine="d0", cause="connect") >= 1
    assert samples("narwhal_request_errors_total", route="/v1/completions", cause="connect") >= 1


@pytest.mark.parametrize(
    ("fault", "defect"),
    [
        ("missing_engine_id", "missing_engine_id"),
        ("non_integer_block_ids", "malformed_block_ids"),
        ("negative_block_ids", "malformed_block_ids"),
    ],
)
async def test_descriptor_rejections_are_counted_by_defect(
    make_stack: StackFactory, fault: str, defect: str
) -> None:
    async with make_stack() as stack:
        arm(stack.engine("p0"), phase="prefill", descriptor=fault, times=1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        samples = await scrape(stack)
    assert samples("narwhal_descriptor_rejections_total", defect=defect) == 1
    assert samples("narwhal_request_errors_total", route="/v1/completions", cause="descriptor") == 1
    # The rejected handoff was crossed; nothing reached a consumer.
    assert samples("narwhal_handoffs_total", kind="crossed") == 1
    assert samples("narwhal_first_byte_seconds_count") == 0


async def test_handoff_kinds_recomputed_and_same_worker(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        arm(stack.engine("p0"), phase="prefill", descriptor="null", times=1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        crossed = await scrape(stack)
    async with make_stack((("b0", "both"),)) as stack:
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        single = await scrape(stack)
    assert crossed("narwhal_handoffs_total", kind="recomputed") == 1
    assert crossed("narwhal_handoffs_total", kind="crossed") == 0
    assert single("narwhal_handoffs_total", kind="same_worker") == 1


async def test_retries_and_budget_denials_are_counted(make_stack: StackFactory) -> None:
    async with make_stack(TWO_PRODUCERS, serving={"max_attempts": 2, "retry_budget": 1}) as stack:
        for _ in range(2):
            for producer in ("p0", "p1"):
                arm(stack.engine(producer), phase="prefill", status=503, times=1)
            assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
            for producer in ("p0", "p1"):
                stack.engine(producer).clear_faults()
        samples = await scrape(stack)
    # First request: a first try and one retry. Second: the budget is spent, no retry.
    assert samples("narwhal_attempts_total") == 3
    assert samples("narwhal_retries_total") == 1
    assert samples("narwhal_retry_budget_denials_total") == 1
    assert samples("narwhal_retry_budget_credit") == 0
    failures = sum(
        samples("narwhal_engine_leg_failures_total", engine=p, cause="http_status")
        for p in ("p0", "p1")
    )
    assert failures == 3


async def test_in_flight_and_queued_gauges_follow_live_requests(make_stack: StackFactory) -> None:
    async with make_stack(sim={"inter_token_s": 0.02}) as stack:
        for engine in stack.server.router.fleet.engines:
            engine.spec = replace(engine.spec, max_decode_seats=1)
        body = {**STREAM, "max_tokens": 15}
        tasks = [asyncio.create_task(stack.post("/v1/completions", body)) for _ in range(2)]
        busy = await scrape(stack)
        for _ in range(100):
            if busy("narwhal_requests_queued") == 1:
                break
            await asyncio.sleep(0.01)
            busy = await scrape(stack)
        assert [status for status, _ in await asyncio.gather(*tasks)] == [200, 200]
        await settled(stack)
        idle = await scrape(stack)
    assert busy("narwhal_requests_in_flight") == 2
    assert busy("narwhal_requests_queued") == 1
    assert busy("narwhal_engine_seats_in_use", engine="d0", phase="decode") == 1
    assert idle("narwhal_requests_in_flight") == 0 and idle("narwhal_requests_queued") == 0
    assert idle("narwhal_engine_seats_in_use", engine="d0", phase="decode") == 0
    # The second request waited for the first one's whole stream.
    assert idle("narwhal_queue_wait_seconds_sum") >= 0.1


async def test_quarantine_shows_in_state_metrics_and_journal(make_stack: StackFactory) -> None:
    async with make_stack(recovery={"failure_quarantine_s": 5.0}) as stack:
        arm(stack.engine("d0"), phase="decode", status=500, times=1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        samples = await scrape(stack)
        engine_lines = await stack.journal(1, kind="engine")
    assert samples("narwhal_engine_state", engine="d0", state="quarantined") == 1
    assert samples("narwhal_engine_state", engine="d0", state="admitted") == 0
    assert samples("narwhal_engine_quarantines_total", engine="d0") == 1
    (line,) = engine_lines
    assert line["event"] == "quarantined" and line["engine"] == "d0"
    assert "http_status" in line["detail"] and abs(line["ts"] - time.time()) < 60


async def test_ejection_probe_and_readmission_are_metrics_journal_lines_and_logs(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    async with make_stack(
        recovery={"eject_after": 1, "readmit_interval_s": 0.1, "max_ejected_fraction": 1}
    ) as stack:
        arm(stack.engine("d0"), phase="decode", status=500, times=1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        ejected = await scrape(stack)
        assert (await engine_state(stack, "d0", "admitted"))["state"] == "admitted"
        readmitted = await scrape(stack)
        lines = await stack.journal(4)

    assert ejected("narwhal_engine_ejections_total", engine="d0") == 1
    assert ejected("narwhal_engine_streak", engine="d0") == 1
    assert ejected("narwhal_engine_state", engine="d0", state="ejected") == 1
    assert readmitted("narwhal_engine_state", engine="d0", state="admitted") == 1
    assert readmitted("narwhal_engine_probes_total", engine="d0", result="success") >= 1
    events = [(line["event"], line["result"]) for line in lines if line["type"] == "engine"]
    assert events[:3] == [("ejected", None), ("probe", "success"), ("readmitted", None)]
    assert [line["type"] for line in lines].count("request") == 1
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("narwhal")]
    assert any(m.startswith("engine d0 ejected: 1 consecutive failures") for m in messages)
    assert any(m.startswith("engine d0 readmitted") for m in messages)
    assert any(
        "failed with 502 (http_status) on engine d0 after 1 attempt" in m for m in messages
    ), messages


async def test_event_loop_lag_is_measured(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        # Block the router's own loop longer than the watch interval, as a slow callback
        # would: the watcher's next wake-up is then at least 0.1 s late.
        await scrape(stack)  # the watcher is running and asleep by now
        time.sleep(0.6)  # noqa: ASYNC251
        for _ in range(40):
            await asyncio.sleep(0.05)
            samples = await scrape(stack)
            if samples("narwhal_event_loop_lag_seconds_count") >= 1:
                break
    late = samples("narwhal_event_loop_lag_seconds_count") - samples(
        "narwhal_event_loop_lag_seconds_bucket", le="0.05"
    )
    assert late >= 1
    assert samples("narwhal_event_loop_lag_seconds_sum") >= 0.1


@pytest.fixture
def narwhal_logger() -> Iterator[None]:
    """Put the `narwhal` logger back as it was after a test configures it."""
    logger = logging.getLogger("narwhal")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


async def test_json_logs_name_cause_and_engine_but_never_the_body(
    make_stack: StackFactory, capsys: pytest.CaptureFixture[str], narwhal_logger: None
) -> None:
    configure_logging("json")
    secret_prompt = "my private prompt about whales"
    async with make_stack() as stack:
        arm(stack.engine("d0"), phase="decode", close_after=1, times=1)
        body = {**STREAM, "prompt": secret_prompt}
        async with stack.http.post(
            stack.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-123"}
        ) as response:
            await response.read()
        await settled(stack)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    (failure,) = [line for line in lines if line["logger"] == "narwhal.request"]
    assert failure["level"] == "warning"
    assert failure["cause"] == "closed_early" and failure["engine"] == "d0"
    assert failure["status"] == 502 and failure["outcome"] == "error"
    assert "decode stream from engine d0" in failure["message"]
    everything = json.dumps(lines)
    assert secret_prompt not in everything and "sk-123" not in everything


async def test_text_logs_are_one_readable_line_per_event(
    make_stack: StackFactory, capsys: pytest.CaptureFixture[str], narwhal_logger: None
) -> None:
    configure_logging("text")
    async with make_stack() as stack:
        arm(stack.engine("p0"), phase="prefill", status=503, times=1)
        await stack.post("/v1/completions", COMPLETION)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
    (line,) = capsys.readouterr().err.splitlines()
    assert " WARNING narwhal.request: request " in line
    assert (
        "failed with 502 (http_status) on engine p0 after 1 attempt: prefill on engine p0" in line
    )


async def test_journal_summarize_reports_outcomes_latency_and_engines(
    make_stack: StackFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    async with make_stack(
        recovery={
            "eject_after": 1,
            "readmit_interval_s": 60.0,
            "max_ejected_fraction": 1,
        }
    ) as stack:
        hold_readmission(stack)
        for _ in range(3):
            assert (await stack.post("/v1/completions", STREAM))[0] == 200
        arm(stack.engine("d0"), phase="decode", status=500, times=1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        await stack.journal(4, kind="request")
        await stack.journal(1, kind="engine")
    with pytest.raises(SystemExit) as exit_info:
        main(["journal", "summarize", str(stack.journal_path)])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "requests: 4" in out
    assert "by outcome: ok 3, error 1" in out
    assert "by status: 200 3, 502 1" in out
    assert "handoffs: crossed 4" in out
    for label in ("ttft", "first byte"):
        assert any(line.startswith(label) and line.split()[-1] == "ms" for line in out.splitlines())
    assert "  d0\n    failures: http_status 1\n    state changes: ejected 1" in out

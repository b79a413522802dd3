"""The chaos soak, short: under random engine faults, crashes and client departures the router
keeps every promise the soak checks; and the rules the soak found missing."""

from __future__ import annotations

import subprocess
import sys

from narwhal.protocol.errors import Cause, engine_error
from narwhal.tools.chaos import FAULTS, OUTAGE, ChaosOptions, format_report, run_chaos
from support.stack import COMPLETION, StackFactory, engine_state

QUICK = {"eject_after": 1, "readmit_interval_s": 0.1, "max_ejected_fraction": 1.0}


async def test_a_fleet_with_every_engine_ejected_is_readmitted_once_its_engines_work(
    make_stack: StackFactory,
) -> None:
    async with make_stack(recovery=QUICK) as stack:
        router = stack.server.router
        for engine in ("p0", "d0"):
            router.breaker.failure(engine_error(Cause.CONNECT, "unreachable", engine))
            assert router.fleet.by_id[engine].ejected
        # Readmission judges them at once (no phase has an admitted engine), and they work.
        for engine in ("p0", "d0"):
            assert (await engine_state(stack, engine, "admitted"))["state"] == "admitted"
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200


async def test_a_short_soak_with_every_fault_keeps_every_promise() -> None:
    options = ChaosOptions(requests=2000, seed=20261130, concurrency=24, fault_every_s=0.06)
    report = await run_chaos(options)
    assert report.ok, format_report(report)
    assert set(report.faults) == {*FAULTS, OUTAGE}
    tally = report.tally
    assert tally.requests == tally.lines == 2000
    # Clients leave part-way in every run. A terminal error event ends only a stream cut
    # where it cannot be continued, which the load makes rare (none in about one run in
    # six): the soak checks each one that happens; tests/e2e/test_engine_faults.py and
    # test_continuation.py make them on purpose.
    assert tally.closed > 0
    # Refused decodes, expired handoffs and departed clients leave handoffs undelivered;
    # the soak checked that the journal and the metrics agree on each producer's.
    assert sum(a.handoffs for a in tally.abandoned.values()) > 0
    # Faults bit: requests were retried onto other engines, and some failed anyway with an
    # engine's error. Which errors those are is chance (a run may bring no 502 at all);
    # the soak checked each one's status against its cause.
    assert tally.retried > 0
    statuses = {status for status, _ in tally.outcomes}
    assert {200, 499} <= statuses
    assert sum(n for (status, _), n in tally.outcomes.items() if status not in (200, 499)) > 0
    assert all(reason != "other" for _, reason in tally.unavailable)
    assert sum(n for (status, _), n in tally.outcomes.items() if status == 200) > 500
    # Consumers crashed mid-answer and answers were continued.
    assert tally.cut["continued"] > 0, format_report(report)


async def test_the_continuation_check_fails_when_the_router_does_not_continue() -> None:
    # Consumers still crash mid-answer, but the router ends those answers with an error.
    options = ChaosOptions(
        requests=400, seed=7, concurrency=16, fault_every_s=0.06, continuation=False
    )
    report = await run_chaos(options)
    cut = report.tally.cut
    assert cut["continued"] == 0 and cut["failed"] > 0, format_report(report)
    check = report.checks["cut answers that could continue were continued (99 %)"]
    assert check.count == 1 and "could be continued" in check.shown[0]


def test_the_chaos_command_prints_its_figures_and_exits_zero_when_all_checks_pass() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "narwhal", "chaos", "--requests", "200", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "200 requests from 32 clients" in out and "faults injected" in out
    assert "left over: in flight 0, queued 0, open engine legs 0, seats in use 0" in out
    assert "abandoned handoffs: " in out
    assert "FAIL" not in out and out.count("PASS") == 11


async def test_a_soak_with_the_role_controller_moving_engines_keeps_every_promise() -> None:
    # One prefill engine against three decode engines (decode-0 pinned): prefill is the
    # pressured phase, so the controller moves decode engines while faults go on.
    options = ChaosOptions(
        requests=1500, seed=20261201, concurrency=24, prefill=1, decode=3, controller=True
    )
    report = await run_chaos(options)
    assert report.ok, format_report(report)
    assert "role moves kept pins and floors" in report.checks
    assert report.tally.moves >= 1
    assert report.tally.requests == report.tally.lines == 1500
    acting = {engine["id"]: engine["acting"] for engine in report.state["engines"]}
    assert acting["decode-0"] == "decode"
    assert report.state["controller"]["moves"].get("ttft_pressure", 0) == report.tally.moves

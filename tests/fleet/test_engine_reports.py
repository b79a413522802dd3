"""Proof of KV use: a consumer whose crossed decodes moved no KV is caught, one reading late."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.engines.scrape import EXTERNAL, LOCAL_COMPUTE, EngineReport
from narwhal.fleet.engine_reports import EngineReports, Window, judge_silence
from narwhal.fleet.table import EngineEvent, Fleet


def report(external: float, computed: float) -> EngineReport:
    return EngineReport(
        prompt_tokens=MappingProxyType({EXTERNAL: external, LOCAL_COMPUTE: computed})
    )


def window(sent: int, before: EngineReport) -> Window:
    return Window(0, before, sent, before)


def test_decodes_that_moved_no_kv_while_the_engine_computed_are_silent_recompute() -> None:
    silent, _ = judge_silence(window(3, report(100, 0)), 3, report(100, 40))
    assert silent


@pytest.mark.parametrize(
    ("sent", "after"),
    [
        (3, report(130, 40)),  # KV moved: the transfers worked
        (0, report(100, 40)),  # nothing sent across: local compute is the engine's own work
        (3, report(100, 0)),  # nothing counted yet at all
        (3, EngineReport()),  # the engine does not count sources
    ],
)
def test_anything_else_is_not_silent(sent: int, after: EngineReport) -> None:
    assert not judge_silence(window(sent, report(100, 0)), sent, after)[0]


def test_decodes_sent_since_the_last_reading_are_judged_only_at_the_next() -> None:
    start = report(0, 0)
    # Two decodes went out after the first reading; the engine has not counted them yet.
    silent, later = judge_silence(Window(0, start, 0, start), 2, report(0, 0))
    assert not silent and later.sent() == 2
    # By the next reading their tokens came over NIXL.
    silent, _ = judge_silence(later, 2, report(60, 0))
    assert not silent


def test_readings_accumulate_tokens_and_report_silence_as_an_engine_event() -> None:
    fleet = Fleet([EngineSpec("d0", "http://127.0.0.1:1", Role.DECODE)])
    events: list[EngineEvent] = []
    fleet.listeners.append(events.append)
    reports = EngineReports(fleet, None, 5.0, 1.0)  # type: ignore[arg-type]
    d0 = fleet.by_id["d0"]
    reports.record(d0, report(10, 5))
    d0.crossed_decodes = 4
    reports.record(d0, report(10, 5))
    reports.record(d0, report(10, 25))
    assert d0.prompt_tokens == {EXTERNAL: 0.0, LOCAL_COMPUTE: 20.0}
    assert d0.silent_recomputes == 1
    assert [(e.kind, e.engine) for e in events] == [("silent_recompute", "d0")]
    assert events[0].detail.startswith("4 crossed decodes moved no KV")


def test_a_reading_counts_what_the_engine_has_beyond_this_routers_seats_as_others() -> None:
    fleet = Fleet([EngineSpec("d0", "http://127.0.0.1:1", Role.DECODE, max_decode_seats=8)])
    reports = EngineReports(fleet, None, 5.0, 1.0)  # type: ignore[arg-type]
    d0 = fleet.by_id["d0"]
    d0.decode_seats = 2
    reports.record(d0, EngineReport(running=5, waiting=1))
    assert d0.others == 4
    assert d0.load() == pytest.approx(2 / 8 + 4 / 8)

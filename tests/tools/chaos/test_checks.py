"""The soak's rules: each allows what the router promises and finds what breaks it."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.tools.chaos.checks import (
    READMIT_GRACE_S,
    AbandonedTotals,
    abandoned_problems,
    add_journal_abandoned,
    check_leaks,
    check_service,
    continuation_problems,
    cut_excuse,
    cut_outcome,
    metrics_abandoned,
    moved_to,
    no_engine_problems,
    role_problems,
    status_allowed,
    unavailable_reason,
)
from narwhal.tools.chaos.downtime import Downtime


@pytest.mark.parametrize(
    ("status", "cause"),
    [
        (200, None),
        (499, None),
        (400, "bad_request"),
        (404, "bad_request"),
        (408, "bad_request"),
        (429, "unavailable"),
        (503, "unavailable"),
        (504, "deadline"),
        (504, "first_token_timeout"),
        (504, "silence"),
        (502, "connect"),
        (502, "descriptor"),
        (502, "http_status"),
        (504, "http_status"),
        (503, "error_object"),
        (429, "error_object"),
    ],
)
def test_a_status_the_rules_give_its_cause_is_allowed(status: int, cause: str | None) -> None:
    assert status_allowed(status, cause)


@pytest.mark.parametrize(
    ("status", "cause"),
    [
        (500, None),
        (503, None),
        (499, "bad_request"),
        (500, "bad_request"),
        (502, "unavailable"),
        (502, "deadline"),
        (504, "connect"),
        (500, "closed_early"),
        (500, "http_status"),
        (400, "error_object"),
        (200, "error_object"),
        (502, "not_a_cause"),
    ],
)
def test_any_other_status_for_a_cause_is_refused(status: int, cause: str | None) -> None:
    assert not status_allowed(status, cause)


STATE: dict[str, Any] = {
    "in_flight": 0,
    "queued": 0,
    "open_engine_legs": 0,
    "engines": [
        {
            "id": "p0",
            "state": "admitted",
            "ejection_reason": None,
            "seats": {"prefill": {"in_use": 0}, "decode": {"in_use": 0}},
        }
    ],
}


def test_a_settled_router_has_no_leaks_and_every_engine_in_service() -> None:
    assert check_leaks(STATE) == [] and check_service(STATE) == []


def test_a_held_seat_an_open_leg_or_an_ejected_engine_is_found() -> None:
    engine = {
        **STATE["engines"][0],
        "state": "ejected",
        "ejection_reason": "3 consecutive failures",
        "seats": {"prefill": {"in_use": 1}, "decode": {"in_use": 0}},
    }
    state = {**STATE, "open_engine_legs": 2, "engines": [engine]}
    assert check_leaks(state) == ["open_engine_legs = 2", "engine p0 holds 1 prefill seats"]
    assert check_service(state) == ["engine p0 is ejected: 3 consecutive failures"]


def unavailable(error: str, status: int = 503, cause: str = "unavailable") -> dict[str, Any]:
    return {
        "client_request_id": "chaos-1-0",
        "status": status,
        "cause": cause,
        "error": error,
        "ts": 20.0,
        "duration_s": 0.5,
    }


NO_DECODE = "no engine can decode: none of the 2 is admitted (2 refuse connections)"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (unavailable("the router's queue is full (32 requests wait)", 429), "queue full"),
        (unavailable("no seat became free within 1 s"), "no seat within the queue timeout"),
        (unavailable(NO_DECODE), "no engine can decode"),
        (unavailable("no engine can prefill: none of the 2 is admitted"), "no engine can prefill"),
        (unavailable("the router is shutting down; retry shortly"), "shutting down"),
        (unavailable("the router shut down before this request finished"), "shutting down"),
        (unavailable("something new"), "other"),
        (unavailable("engine said so", 503, "error_object"), "an engine's error_object"),
        ({**unavailable("upstream"), "status": 502, "cause": "connect"}, None),
    ],
)
def test_a_429_or_503_is_filed_under_the_reason_its_error_begins_with(
    line: dict[str, Any], reason: str | None
) -> None:
    assert unavailable_reason(line) == reason


def decode_downtime(*spans: tuple[str, float, float]) -> Downtime:
    downtime = Downtime({"decode": ["d0", "d1"], "prefill": ["p0"]})
    for engine, down, up in spans:
        downtime.down(engine, down)
        downtime.up(engine, up)
    return downtime


def test_a_503_for_lack_of_an_engine_while_every_engine_of_its_phase_was_down_passes() -> None:
    downtime = decode_downtime(("d0", 19.0, 21.0), ("d1", 19.8, 25.0))
    assert no_engine_problems(unavailable(NO_DECODE), downtime) == []


def test_a_503_for_lack_of_an_engine_while_one_accepted_connections_is_found() -> None:
    downtime = decode_downtime(("d0", 19.0, 21.0), ("p0", 0.0, 30.0))
    assert no_engine_problems(unavailable(NO_DECODE), downtime) == [
        f"chaos-1-0: 503 {NO_DECODE!r}, but no moment of its 0.50 s found every decode "
        "engine down (d1 accepted connections throughout)"
    ]


def test_a_503_for_lack_of_an_engine_just_after_one_came_back_passes_within_the_grace() -> None:
    back = 19.5 - READMIT_GRACE_S + 0.1
    downtime = decode_downtime(("d0", 10.0, back), ("d1", 10.0, 25.0))
    assert no_engine_problems(unavailable(NO_DECODE), downtime) == []
    too_long_ago = decode_downtime(("d0", 10.0, back - 0.2), ("d1", 10.0, 25.0))
    assert len(no_engine_problems(unavailable(NO_DECODE), too_long_ago)) == 1


def test_other_503s_are_not_judged_by_engine_downtime() -> None:
    downtime = decode_downtime()
    assert no_engine_problems(unavailable("no seat became free within 1 s"), downtime) == []
    assert no_engine_problems(unavailable(NO_DECODE, 429), downtime) == []


def test_abandoned_handoffs_in_the_journal_must_match_the_metrics() -> None:
    journal: dict[str, AbandonedTotals] = {}
    lines: list[dict[str, Any]] = [
        {
            "abandoned_handoffs": {
                "handoffs": [{"producer": "p0", "blocks": 3, "block_seconds": 0.1}]
            }
        },
        {
            "abandoned_handoffs": {
                "handoffs": [{"producer": "p0", "blocks": 1, "block_seconds": 0.2}]
            }
        },
        {"abandoned_handoffs": {"count": 0, "handoffs": []}},
        {},  # a line from before the field existed
    ]
    for line in lines:
        add_journal_abandoned(line, journal)
    exposition = "\n".join(
        [
            "# TYPE narwhal_engine_abandoned_handoffs counter",
            'narwhal_engine_abandoned_handoffs_total{engine="p0"} 2.0',
            'narwhal_engine_abandoned_handoffs_total{engine="p1"} 0.0',
            "# TYPE narwhal_engine_abandoned_blocks counter",
            'narwhal_engine_abandoned_blocks_total{engine="p0"} 4.0',
            'narwhal_engine_abandoned_blocks_total{engine="p1"} 0.0',
            "# TYPE narwhal_engine_abandoned_block_seconds counter",
            'narwhal_engine_abandoned_block_seconds_total{engine="p0"} 0.30000000000000004',
            'narwhal_engine_abandoned_block_seconds_total{engine="p1"} 0.0',
            "",
        ]
    )
    metrics = metrics_abandoned(exposition)
    assert metrics["p0"] == AbandonedTotals(2, 4, 0.30000000000000004)
    assert abandoned_problems(journal, metrics) == []
    journal["p1"] = AbandonedTotals(1, 2, 5.0)
    (problem,) = abandoned_problems(journal, metrics)
    assert problem.startswith("producer p1: the journal has 1 abandoned handoffs, 2 blocks")
    del journal["p1"]
    metrics["p0"].blocks = 5
    assert len(abandoned_problems(journal, metrics)) == 1


def test_a_role_change_line_names_the_phase_its_engine_moved_to() -> None:
    line = {
        "type": "engine",
        "event": "role_change",
        "engine": "d1",
        "detail": "decode -> prefill; role controller: ttft_pressure: ...",
    }
    assert moved_to(line) == "prefill"
    assert moved_to({**line, "event": "drained"}) is None
    assert moved_to({"type": "request"}) is None


def test_a_move_of_a_pinned_engine_or_below_a_floor_is_a_problem() -> None:
    fine = role_problems("d1", "prefill", {"d0"}, {"prefill": 2, "decode": 1}, floor=1)
    assert fine == []
    pinned = role_problems("d0", "prefill", {"d0"}, {"prefill": 2, "decode": 1}, floor=1)
    assert pinned == ["pinned engine d0 moved to prefill"]
    emptied = role_problems("d1", "prefill", set(), {"prefill": 3, "decode": 0}, floor=1)
    assert emptied == ["after d1 moved to prefill, decode had 0 engines (floor 1)"]


def _cut(status: int, cause: str | None = None, kind: str | None = None) -> dict[str, Any]:
    return {"cut": True, "status": status, "cause": cause, "continuation_refused_kind": kind}


def test_a_cut_answer_counts_against_the_router_unless_it_could_not_be_continued() -> None:
    assert cut_outcome({"cut": False, "status": 502, "cause": "connect"}) is None
    assert cut_outcome(_cut(200)) == "continued"
    for excused, why in (
        (_cut(499), "client left"),
        (_cut(504, "deadline"), "deadline"),
        (_cut(502, "closed_early", "fleet"), "fleet"),
        (_cut(502, "closed_early", "budget"), "budget"),
        (_cut(502, "closed_early", "answer"), "answer"),
    ):
        assert cut_outcome(excused) == "excused", excused
        assert cut_excuse(excused) == why
    assert cut_outcome(_cut(502, "closed_early", "off")) == "failed"
    assert cut_outcome(_cut(504, "first_token_timeout")) == "failed"


def test_the_continuation_check_wants_99_percent_of_what_could_continue() -> None:
    assert continuation_problems(0, 0) == []
    assert continuation_problems(99, 1) == []
    assert continuation_problems(98, 2) == [
        "only 98 of 100 answers cut mid-way that could be continued ended complete"
    ]
    assert continuation_problems(0, 3) != []

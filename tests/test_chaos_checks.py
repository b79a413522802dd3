"""The chaos soak's judges: each check finds the failure it is there to find."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from narwhal.chaos import (
    CLIENT_CLOSED,
    FAULTS,
    Sent,
    Tally,
    check_leaks,
    check_service,
    memory_trend,
    status_allowed,
    terminal_code,
)
from narwhal.sim.faults import Fault


def test_the_soak_draws_every_fault_the_simulator_has_and_each_can_be_armed() -> None:
    rng = random.Random(0)
    drawn = [draw(rng) for draw in FAULTS.values() for _ in range(20)]
    for fault in drawn:
        Fault.from_json(fault)
    keys = {key for fault in drawn for key in fault}
    assert keys == {field.name for field in dataclasses.fields(Fault)} - {"times"}


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


def line(index: int, status: int = 200, cause: str | None = None, **changes: Any) -> dict[str, Any]:
    outcome = {200: "ok", 499: "client_closed", 504: "timeout"}.get(
        status, "client_error" if status < 500 else "error"
    )
    return {
        "type": "request",
        "client_request_id": f"chaos-1-{index}",
        "status": status,
        "cause": cause,
        "outcome": outcome,
        "error": None if status == 200 else "failed",
        "attempts": 1,
        **changes,
    }


def tally_of(sent: list[Sent], lines: list[dict[str, Any]]) -> Tally:
    tally = Tally(seed=1, max_attempts=2)
    for s in sent:
        tally.add_sent(s)
    for entry in lines:
        tally.add_line(entry)
    tally.finish()
    return tally


def test_one_line_per_request_in_either_order_passes() -> None:
    tally = Tally(seed=1, max_attempts=2)
    tally.add_line(line(0))
    tally.add_sent(Sent(0, stream=False, status=200))
    tally.add_sent(Sent(1, stream=True, status=200, terminal=502))
    tally.add_line(line(1, 502, "closed_early"))
    tally.finish()
    assert tally.once.count == tally.rules.count == tally.views.count == 0
    assert tally.requests == tally.lines == 2 and tally.terminal == 1


def test_a_request_without_a_line_a_line_without_a_request_and_a_double_line_are_found() -> None:
    tally = tally_of(
        [Sent(0, stream=False, status=200), Sent(1, stream=False, status=200)],
        [line(1), line(1), line(7), line(0, client_request_id="someone-else")],
    )
    assert tally.once.count == 4
    assert sorted(tally.once.shown) == [
        "chaos-1-0: no journal line",
        "chaos-1-1: journaled twice",
        "chaos-1-7: never sent",
        "someone-else: journaled but never sent",
    ]


def test_a_client_that_waited_in_vain_is_a_problem() -> None:
    tally = tally_of([Sent(0, stream=False, hung=True)], [line(0)])
    assert tally.once.shown == ["chaos-1-0: no answer within the client's patience"]


def test_a_line_breaking_the_status_rules_is_found() -> None:
    tally = tally_of(
        [Sent(0, stream=False, status=502)],
        [line(0, 502, "deadline", outcome="timeout", attempts=3)],
    )
    assert tally.rules.shown == [
        "chaos-1-0: status 502 for cause deadline",
        "chaos-1-0: outcome timeout for status 502",
        "chaos-1-0: 3 attempts, over 2",
    ]


def test_a_499_for_a_client_that_stayed_is_found() -> None:
    tally = tally_of([Sent(0, stream=False, status=200)], [line(0, CLIENT_CLOSED)])
    assert tally.views.shown == ["chaos-1-0: journaled 499 but its client stayed"]


def test_a_client_told_other_than_the_journal_is_found_unless_it_left() -> None:
    tally = tally_of(
        [
            Sent(0, stream=True, status=200),
            Sent(1, stream=True, status=200, left=True),
            Sent(2, stream=True, status=200, terminal=504),
        ],
        [line(0, 502, "closed_early"), line(1, 502, "closed_early"), line(2, 504, "silence")],
    )
    assert tally.views.shown == ["chaos-1-0: the client was told 200, the journal says 502"]


def test_only_the_first_problems_are_kept_but_all_are_counted() -> None:
    tally = tally_of([], [line(i) for i in range(20)])
    assert tally.once.count == 20 and len(tally.once.shown) == 5


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


MB = 2**20


def test_flat_memory_after_warm_up_is_stable() -> None:
    warm_up = [(t, (40 + t) * MB) for t in range(10)]
    flat = [(10 + t, (50 + t % 3) * MB) for t in range(100)]
    trend = memory_trend(warm_up + flat)
    assert trend.stable and abs(trend.slope_mb_per_min) < 1


def test_memory_that_keeps_growing_is_not_stable() -> None:
    samples = [(t, 50 * MB + t * MB // 2) for t in range(100)]
    trend = memory_trend(samples)
    assert not trend.stable and trend.slope_mb_per_min == pytest.approx(30)


def test_a_stream_ending_in_an_error_event_has_its_code_and_a_clean_one_none() -> None:
    clean = b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
    failed = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"code":504}}\n\ndata: [DONE]\n\n'
    assert terminal_code(clean) is None
    assert terminal_code(failed) == 504

"""The soak's rules: each allows what the router promises and finds what breaks it."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.chaos.checks import check_leaks, check_service, status_allowed


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

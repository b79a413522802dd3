"""The soak's tally: one outcome per request, statuses by the rules, clients' views, counted."""

from __future__ import annotations

from typing import Any

from narwhal.tools.chaos.checks import CLIENT_CLOSED
from narwhal.tools.chaos.downtime import Downtime
from narwhal.tools.chaos.load import Sent
from narwhal.tools.chaos.tally import Tally


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


def test_429s_and_503s_are_counted_by_reason_and_a_503_for_lack_of_an_engine_is_judged() -> None:
    downtime = Downtime({"decode": ["d0"]})
    downtime.down("d0", 10.0)
    downtime.up("d0", 11.0)
    no_engine = "no engine can decode: none of the 1 is admitted (1 refuse connections)"
    tally = Tally(seed=1, max_attempts=2, downtime=downtime)
    for index, status, error, ts in [
        (0, 503, no_engine, 10.5),
        (1, 503, no_engine, 30.0),
        (2, 429, "the router's queue is full (32 wait)", 30.0),
    ]:
        tally.add_line(line(index, status, "unavailable", error=error, ts=ts, duration_s=0.1))
    tally.add_line(line(3, 502, "connect"))
    assert tally.unavailable == {(503, "no engine can decode"): 2, (429, "queue full"): 1}
    assert tally.no_engine.count == 1 and tally.no_engine.shown[0].startswith("chaos-1-1: 503")

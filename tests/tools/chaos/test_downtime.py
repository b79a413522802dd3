"""The soak's record of engine downtime: a phase is down where all its engines' spans meet."""

from __future__ import annotations

from narwhal.tools.chaos.downtime import Downtime


def decode_fleet(*spans: tuple[str, float, float | None]) -> Downtime:
    downtime = Downtime({"decode": ["d0", "d1"], "prefill": ["p0"]})
    for engine, down, up in spans:
        downtime.down(engine, down)
        if up is not None:
            downtime.up(engine, up)
    return downtime


def test_a_phase_is_down_only_where_the_down_spans_of_all_its_engines_overlap() -> None:
    downtime = decode_fleet(("d0", 10.0, 12.0), ("d1", 11.0, 13.0))
    assert downtime.all_down("decode", 11.5, 11.6, grace_s=0.0)
    assert downtime.all_down("decode", 9.0, 11.2, grace_s=0.0)
    assert not downtime.all_down("decode", 9.0, 10.9, grace_s=0.0)
    assert not downtime.all_down("decode", 12.1, 12.9, grace_s=0.0)


def test_spans_that_never_meet_leave_the_phase_up_even_when_each_engine_was_down() -> None:
    downtime = decode_fleet(("d0", 10.0, 11.0), ("d1", 11.5, 12.0))
    assert not downtime.all_down("decode", 9.0, 13.0, grace_s=0.0)
    assert downtime.accepting_throughout("decode", 9.0, 13.0, grace_s=0.0) == []


def test_an_engine_back_for_less_than_the_grace_still_counts_as_down() -> None:
    downtime = decode_fleet(("d0", 10.0, 12.0), ("d1", 12.5, 14.0))
    assert not downtime.all_down("decode", 12.6, 12.7, grace_s=0.0)
    assert downtime.all_down("decode", 12.6, 12.7, grace_s=1.0)


def test_an_engine_not_yet_back_is_down_from_then_on() -> None:
    downtime = decode_fleet(("d0", 10.0, None), ("d1", 50.0, None))
    assert downtime.all_down("decode", 100.0, 101.0, grace_s=0.0)


def test_a_second_stop_while_down_keeps_the_first_span() -> None:
    downtime = decode_fleet(("d0", 10.0, None), ("d0", 11.0, 12.0))
    assert downtime.spans("d0") == [(10.0, 12.0)]


def test_the_engines_that_accepted_connections_throughout_are_named() -> None:
    downtime = decode_fleet(("d0", 10.0, 12.0))
    assert downtime.accepting_throughout("decode", 10.5, 11.0, grace_s=0.0) == ["d1"]
    assert downtime.accepting_throughout("decode", 12.5, 13.0, grace_s=1.0) == ["d1"]
    assert downtime.accepting_throughout("decode", 13.5, 14.0, grace_s=1.0) == ["d0", "d1"]


def test_a_moved_engine_serves_its_new_phase_from_its_move_on() -> None:
    downtime = decode_fleet(("d0", 10.0, None))
    downtime.moved("d1", "prefill", 20.0)
    assert downtime.serving_at("decode", 19.0) == ("d0", "d1")
    assert downtime.serving_at("decode", 20.0) == ("d0",)
    assert downtime.serving_at("prefill", 21.0) == ("d1", "p0")
    # After the move decode's only engine is d0, down since 10: decode is down.
    assert downtime.all_down("decode", 20.5, 21.0, grace_s=0.0)
    assert not downtime.all_down("decode", 15.0, 19.0, grace_s=0.0)
    # A request that lived across the move saw d1 serve decode, up, before it.
    assert not downtime.all_down("decode", 19.0, 19.9, grace_s=0.0)
    assert downtime.all_down("decode", 19.0, 21.0, grace_s=0.0)
    assert downtime.accepting_throughout("decode", 19.0, 21.0, grace_s=0.0) == ["d1"]
    assert downtime.moves() == [(20.0, "d1", "prefill")]

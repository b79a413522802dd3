"""Each router process's share of the seat limits, and the others' load in placement."""

from __future__ import annotations

import pytest

from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.fleet.seat_share import WHOLE, SeatShare, others_load
from narwhal.fleet.table import Engine, Phase


@pytest.mark.parametrize("limit", range(0, 20))
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_shares_never_add_up_past_the_limit(limit: int, replicas: int, workers: int) -> None:
    shares = [SeatShare(replicas, workers, w).of(limit) for w in range(workers)]
    if limit == 0:
        assert shares == [None] * workers
        return
    assert all(share is not None for share in shares)
    total = sum(share or 0 for share in shares)
    # One replica's workers use all of its part; the parts of all replicas fit the limit.
    assert total == limit // replicas and total * replicas <= limit
    assert max(share or 0 for share in shares) - min(share or 0 for share in shares) <= 1


def test_one_process_holds_every_seat() -> None:
    assert WHOLE.of(8) == 8 and WHOLE.of(0) is None


def test_a_worker_with_no_share_never_gets_a_seat() -> None:
    engine = Engine(
        EngineSpec("d0", "http://d0", Role.DECODE, max_decode_seats=1),
        share=SeatShare(workers=2, worker=1),
    )
    assert engine.seat_limit(Phase.DECODE) == 0
    assert not engine.has_seat(Phase.DECODE)


def test_others_are_what_the_engine_reports_beyond_our_seats() -> None:
    assert others_load(running=5, waiting=2, own_seats=3) == 4
    assert others_load(running=1, waiting=None, own_seats=3) == 0
    assert others_load(running=None, waiting=None, own_seats=0) == 0


def test_placement_load_counts_what_others_have_on_the_engine() -> None:
    spec = EngineSpec("d0", "http://d0", Role.DECODE, max_decode_seats=8)
    quiet, crowded = Engine(spec), Engine(spec)
    quiet.decode_seats = crowded.decode_seats = 2
    crowded.others = 4
    assert quiet.load() == pytest.approx(2 / 8)
    assert crowded.load() == pytest.approx(2 / 8 + 4 / 8)

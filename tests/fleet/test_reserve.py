"""Seats held back: the last free decode seats of a busy pool go to favoured requests."""

from __future__ import annotations

from narwhal.fleet.reserve import SeatReserve
from narwhal.fleet.scheduler import Claim

FLOOD = Claim("flood", priority=1)
LIGHT = Claim("light", priority=1)
VIP = Claim("vip", priority=0)


def test_a_lighter_tenant_of_the_band_or_a_more_important_band_is_favoured() -> None:
    reserve = SeatReserve(2)
    for _ in range(3):
        reserve.took("pool", FLOOD)
    assert reserve.favoured("pool", LIGHT) and reserve.favoured("pool", VIP)
    # The heaviest holder, and a less important band, are not.
    assert not reserve.favoured("pool", FLOOD)
    assert not reserve.favoured("pool", Claim("bulk", priority=4))
    # Another pool's holders count for nothing here.
    assert not reserve.favoured("other", LIGHT)


def test_weights_set_each_tenants_share_of_the_seats() -> None:
    reserve = SeatReserve(1)
    heavy = Claim("heavy", priority=1, weight=3.0)
    for _ in range(3):
        reserve.took("pool", heavy)
    reserve.took("pool", LIGHT)
    # Three seats at weight 3 are one per unit of weight, as one seat at weight 1 is.
    assert not reserve.favoured("pool", LIGHT) and not reserve.favoured("pool", heavy)
    reserve.gave_back("pool", heavy)
    assert reserve.favoured("pool", LIGHT) is False and reserve.favoured("pool", heavy)


def test_only_the_last_seats_are_held_back() -> None:
    reserve = SeatReserve(2)
    reserve.took("pool", FLOOD)
    assert not reserve.holds_back("pool", FLOOD, free=3)
    assert reserve.holds_back("pool", FLOOD, free=2)
    assert not reserve.holds_back("pool", LIGHT, free=0)


def test_seats_given_back_are_forgotten() -> None:
    reserve = SeatReserve(1)
    reserve.took("pool", FLOOD)
    reserve.took("pool", FLOOD)
    reserve.gave_back("pool", FLOOD)
    assert reserve.held("pool") == {"flood": 1}
    reserve.gave_back("pool", FLOOD)
    reserve.gave_back("pool", FLOOD)
    assert reserve.held("pool") == {} and not reserve.favoured("pool", LIGHT)

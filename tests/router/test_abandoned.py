"""What a dropped descriptor costs its producer: blocks, block-seconds, and what is still pinned."""

from __future__ import annotations

import orjson
import pytest

from narwhal.router.abandoned import (
    AbandonedHandoffs,
    abandonment,
    block_count,
    journal_field,
)


def descriptor(block_ids: object) -> bytes:
    return orjson.dumps({"remote_engine_id": "e", "remote_block_ids": block_ids})


@pytest.mark.parametrize(
    ("block_ids", "count"),
    [
        ([3, 4, 5], 3),
        ([[3, 4, 5]], 3),
        ([[1, 2], [7]], 3),
        ([], 0),
        ([[]], 0),
        (None, 0),
        ("junk", 0),
        ([["a", "b"]], 0),
        ([1, -2], 0),
    ],
)
def test_blocks_are_the_ids_of_every_group(block_ids: object, count: int) -> None:
    assert block_count(descriptor(block_ids)) == count


def test_unreadable_or_absent_descriptors_name_no_blocks() -> None:
    assert block_count(None) == 0
    assert block_count(b"{not json") == 0
    assert block_count(b"[1, 2]") == 0


def test_a_null_descriptor_pins_nothing() -> None:
    # Same-worker, fallback and recomputed handoffs carry no descriptor.
    assert abandonment("p0", None, started_at=0.0, now=1.0, lease_s=30.0) is None


def test_block_seconds_are_the_lease_left_when_dropped() -> None:
    lost = abandonment("p0", descriptor([[1, 2, 3, 4]]), started_at=10.0, now=12.5, lease_s=30.0)
    assert lost is not None
    assert (lost.producer, lost.blocks, lost.pinned_s, lost.expires_at) == ("p0", 4, 27.5, 40.0)
    assert lost.block_seconds == 110.0


def test_a_descriptor_past_its_lease_is_abandoned_but_pins_no_time() -> None:
    lost = abandonment("p0", descriptor([1, 2]), started_at=0.0, now=31.0, lease_s=30.0)
    assert lost is not None and lost.blocks == 2 and lost.block_seconds == 0.0


def test_tallies_are_per_producer_and_pinned_blocks_expire_with_their_lease() -> None:
    ledger = AbandonedHandoffs()
    for producer, started, blocks in (("p0", 0.0, [1, 2]), ("p0", 5.0, [3]), ("p1", 2.0, [4])):
        lost = abandonment(producer, descriptor(blocks), started_at=started, now=6.0, lease_s=10)
        assert lost is not None
        ledger.record(lost)
    assert ledger.summary("p0", 6.0) == {
        "handoffs": 2,
        "blocks": 3,
        "block_seconds": 2 * 4.0 + 1 * 9.0,
        "pinned_blocks": 3,
    }
    # The first handoff's lease ends at 10 s, the second's at 15 s.
    assert ledger.tally("p0").pinned(10.0) == 1
    assert ledger.tally("p0").pinned(14.9) == 1
    assert ledger.tally("p0").pinned(15.0) == 0
    assert ledger.summary("p0", 20.0)["handoffs"] == 2
    assert ledger.summary("p1", 6.0)["pinned_blocks"] == 1
    assert ledger.summary("p9", 6.0) == {
        "handoffs": 0,
        "blocks": 0,
        "block_seconds": 0.0,
        "pinned_blocks": 0,
    }


def test_leases_recorded_out_of_order_still_expire_in_order() -> None:
    ledger = AbandonedHandoffs()
    for started in (5.0, 0.0, 3.0):
        lost = abandonment("p0", descriptor([1]), started_at=started, now=5.0, lease_s=10)
        assert lost is not None
        ledger.record(lost)
    tally = ledger.tally("p0")
    assert [tally.pinned(t) for t in (9.0, 10.0, 13.0, 15.0)] == [3, 2, 1, 0]


def test_the_journal_field_sums_a_requests_handoffs() -> None:
    assert journal_field([]) == {"count": 0, "blocks": 0, "block_seconds": 0, "handoffs": []}
    first = abandonment("p0", descriptor([1, 2]), started_at=0.0, now=10.0, lease_s=30.0)
    second = abandonment("p1", descriptor([3]), started_at=20.0, now=21.0, lease_s=30.0)
    assert first is not None and second is not None
    assert journal_field([first, second]) == {
        "count": 2,
        "blocks": 3,
        "block_seconds": 40.0 + 29.0,
        "handoffs": [
            {"producer": "p0", "blocks": 2, "block_seconds": 40.0},
            {"producer": "p1", "blocks": 1, "block_seconds": 29.0},
        ],
    }

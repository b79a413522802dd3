"""Where limit state lives: one process's rows, and one file every worker maps."""

from __future__ import annotations

import contextlib
import multiprocessing
import queue as queue_module
import struct
import time
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from narwhal.tenants.buckets import Bucket, Rate
from narwhal.tenants.store import (
    HEADER,
    INITIAL_SLOTS,
    MAGIC,
    LimitStore,
    LocalStore,
    Row,
    SharedStore,
    limits_path,
)

# A clock that stands still: the buckets refill nothing while processes race for them.
NOW = 1000.0


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return limits_path(tmp_path)


@pytest.fixture(params=["local", "shared"])
def store(request: pytest.FixtureRequest, path: Path) -> Iterator[LimitStore]:
    made: LimitStore = LocalStore() if request.param == "local" else SharedStore(path, 1, 0)
    yield made
    made.close()


def take_one(rate: Rate, worker: int) -> Callable[[Row], bool]:
    """A change: one request from the requests bucket, counted in flight, or nothing."""

    def change(row: Row) -> bool:
        taken = rate.take(row.requests, 1, NOW)
        if taken is None:
            return False
        row.requests = taken
        row.in_flight[worker] += 1
        return True

    return change


@pytest.mark.parametrize("now", [0.0, NOW])
def test_a_new_row_is_full_at_any_instant_with_nothing_in_flight(
    store: LimitStore, now: float
) -> None:
    row = store.read(store.slot("batch"))
    assert Rate(5).refill(row.requests, now).level == 5.0
    assert Rate(9).refill(row.tokens, now).level == 9.0
    assert row.total_in_flight == 0


def test_a_name_keeps_its_slot_and_names_do_not_share_one(store: LimitStore) -> None:
    a, b = store.slot("a"), store.slot("b")
    assert a != b
    assert store.slot("a") == a


def test_apply_keeps_what_the_change_left_and_returns_its_result(store: LimitStore) -> None:
    slot = store.slot("batch")

    def change(row: Row) -> str:
        row.tokens = Bucket(3.0, 4.0)
        row.in_flight[store.worker] += 2
        return "done"

    assert store.apply(slot, change) == "done"
    row = store.read(slot)
    assert row.tokens == Bucket(3.0, 4.0)
    assert row.in_flight[store.worker] == 2


def test_read_is_a_copy(store: LimitStore) -> None:
    slot = store.slot("batch")
    store.read(slot).in_flight[0] = 7
    assert store.read(slot).total_in_flight == 0


def test_reset_worker_zeroes_that_workers_counts_in_every_row(path: Path) -> None:
    zero, one = SharedStore(path, 2, 0), SharedStore(path, 2, 1)
    try:
        slots = [zero.slot("a"), zero.slot("b")]
        for slot in slots:
            zero.apply(slot, lambda row: row.in_flight.__setitem__(0, 3))
            one.apply(slot, lambda row: row.in_flight.__setitem__(1, 4))
        zero.reset_worker(1)
        assert [one.read(slot).in_flight for slot in slots] == [[3, 0], [3, 0]]
    finally:
        zero.close()
        one.close()


def test_local_reset_worker() -> None:
    store = LocalStore()
    slot = store.slot("a")
    store.apply(slot, lambda row: row.in_flight.__setitem__(0, 5))
    store.reset_worker(0)
    assert store.read(slot).in_flight == [0]


def test_two_openers_share_rows_found_by_name_in_any_order(path: Path) -> None:
    first, second = SharedStore(path, 2, 0), SharedStore(path, 2, 1)
    try:
        # Each looks the names up in its own order (a reload reaching the workers in turn).
        a, b = first.slot("a"), first.slot("b")
        assert second.slot("b") == b
        assert second.slot("a") == a
        first.apply(a, lambda row: setattr(row, "requests", Bucket(1.0, 2.0)))
        assert second.read(a).requests == Bucket(1.0, 2.0)
    finally:
        first.close()
        second.close()


def test_opening_as_a_worker_zeroes_what_its_predecessor_held(path: Path) -> None:
    old = SharedStore(path, 2, 1)
    slot = old.slot("a")
    old.apply(slot, lambda row: row.in_flight.__setitem__(1, 5))
    old.close()  # killed: its counts stay behind
    other = SharedStore(path, 2, 0)
    other.apply(slot, lambda row: row.in_flight.__setitem__(0, 2))
    replacement = SharedStore(path, 2, 1)
    try:
        assert replacement.read(replacement.slot("a")).in_flight == [2, 0]
    finally:
        other.close()
        replacement.close()


def test_the_file_grows_when_its_slots_are_taken(path: Path) -> None:
    first, second = SharedStore(path, 1, 0), SharedStore(path, 1, 0)
    try:
        assert second.slot("early") == 0
        names = [f"t{index}" for index in range(INITIAL_SLOTS * 3)]
        slots = [first.slot(name) for name in names]
        assert len(set(slots)) == len(names)
        last = first.slot(names[-1])
        first.apply(last, lambda row: setattr(row, "tokens", Bucket(7.0, 1.0)))
        # The other opener mapped the smaller file: it maps the larger one when it looks up.
        assert second.slot(names[-1]) == last
        assert second.read(last).tokens == Bucket(7.0, 1.0)
        assert second.read(second.slot("early")).total_in_flight == 0
    finally:
        first.close()
        second.close()


def test_a_long_name_has_a_slot_of_its_own(store: LimitStore) -> None:
    long_a, long_b = "a" * 100, "a" * 99 + "b"
    assert len({store.slot(long_a), store.slot(long_b), store.slot("a" * 64)}) == 3
    assert store.slot(long_a) == store.slot(long_a)


@pytest.mark.parametrize("stale", [b"", b"garbage", MAGIC + b"\x00" * 200])
def test_a_foreign_or_stale_file_is_laid_out_afresh(path: Path, stale: bytes) -> None:
    path.write_bytes(stale)
    store = SharedStore(path, 2, 0)
    try:
        assert store.read(store.slot("a")).in_flight == [0, 0]
    finally:
        store.close()


def test_a_file_of_another_magic_is_laid_out_afresh(path: Path) -> None:
    old = SharedStore(path, 2, 0)
    old.slot("a")
    old.close()
    raw = bytearray(path.read_bytes())
    raw[:8] = b"NOTOURS!"
    path.write_bytes(bytes(raw))
    store = SharedStore(path, 2, 0)
    try:
        assert HEADER.unpack(path.read_bytes()[: HEADER.size]) == (MAGIC, 2, INITIAL_SLOTS, 0)
    finally:
        store.close()


def test_another_worker_count_lays_the_file_out_afresh(path: Path) -> None:
    old = SharedStore(path, 3, 0)
    old.apply(old.slot("a"), lambda row: row.in_flight.__setitem__(2, 9))
    old.close()
    store = SharedStore(path, 2, 0)
    try:
        assert HEADER.unpack(path.read_bytes()[: HEADER.size])[1] == 2
        assert store.read(store.slot("a")).in_flight == [0, 0]
    finally:
        store.close()


def test_a_worker_outside_the_count_is_refused(path: Path) -> None:
    with pytest.raises(ValueError):
        SharedStore(path, 2, 2)
    store = SharedStore(path, 2, 0)
    try:
        with pytest.raises(ValueError):
            store.reset_worker(5)
    finally:
        store.close()


def test_a_closed_store_refuses_use(path: Path) -> None:
    store = SharedStore(path, 1, 0)
    slot = store.slot("a")
    store.close()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.read(slot)


Result = tuple[int, int, int]


def _hammer(path: str, worker: int, capacity: int, start: Barrier, queue: Queue[Result]) -> None:
    """One worker process: twice `capacity` requests at the shared bucket, as fast as it
    can; it reports how many it was admitted and its in-flight column."""
    store = SharedStore(Path(path), 2, worker)
    slot = store.slot("batch")
    change = take_one(Rate(capacity), worker)
    start.wait(timeout=120)
    admitted = sum(1 for _ in range(2 * capacity) if store.apply(slot, change))
    column = store.read(slot).in_flight[worker]
    store.close()
    queue.put((worker, admitted, column))


def _count(path: str, worker: int, times: int, start: Barrier, queue: Queue[Result]) -> None:
    """One worker process: `times` increments of a value the other increments too."""
    store = SharedStore(Path(path), 2, worker)
    slot = store.slot("batch")

    def bump(row: Row) -> None:
        # Read-modify-write of a value both processes change: a lost update shows.
        row.tokens = Bucket(row.tokens.level + 1, 0.0)

    start.wait(timeout=120)
    for _ in range(times):
        store.apply(slot, bump)
    store.close()
    queue.put((worker, times, 0))


def _run_two(target: Callable[..., None], path: Path, count: int) -> list[Result]:
    """`target` in two spawned processes, workers 0 and 1 of 2; their results by worker."""
    context = multiprocessing.get_context("spawn")
    # Both begin together, once both have opened the file (the first lays it out).
    start = context.Barrier(2)
    queue: Queue[Result] = context.Queue()
    processes = [
        context.Process(target=target, args=(str(path), worker, count, start, queue))
        for worker in (0, 1)
    ]
    for process in processes:
        process.start()
    results: list[Result] = []
    deadline = time.monotonic() + 120
    while len(results) < len(processes):
        # A process that died says so at once, rather than at the deadline.
        assert all(process.exitcode in (None, 0) for process in processes)
        assert time.monotonic() < deadline
        with contextlib.suppress(queue_module.Empty):
            results.append(queue.get(timeout=0.5))
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return sorted(results)


@pytest.mark.parametrize("capacity", [100, 5000])
def test_two_processes_hammering_one_bucket_admit_exactly_what_it_holds(
    path: Path, capacity: int
) -> None:
    # The clock stands still (NOW): the bucket refills nothing, so it admits its capacity.
    results = _run_two(_hammer, path, capacity)
    assert sum(admitted for _, admitted, _ in results) == capacity
    # Each process's in-flight column counts exactly what it was admitted.
    assert all(column == admitted for _, admitted, column in results)
    store = SharedStore(path, 2, 0)
    try:
        assert store.read(store.slot("batch")).requests.level == 0.0
    finally:
        store.close()


def test_two_processes_lose_no_update(path: Path) -> None:
    # Start from zero rather than from the unused bucket's +inf.
    store = SharedStore(path, 2, 0)
    store.apply(store.slot("batch"), lambda row: setattr(row, "tokens", Bucket(0.0, 0.0)))
    store.close()
    _run_two(_count, path, 20000)
    store = SharedStore(path, 2, 0)
    try:
        assert store.read(store.slot("batch")).tokens.level == 40000.0
    finally:
        store.close()


def test_the_header_says_magic_workers_and_slots(path: Path) -> None:
    store = SharedStore(path, 4, 3)
    try:
        store.slot("a")
        magic, workers, slots, used = HEADER.unpack(path.read_bytes()[: HEADER.size])
        assert (magic, workers, slots, used) == (MAGIC, 4, INITIAL_SLOTS, 1)
        assert struct.calcsize("<4d4i") == 48
    finally:
        store.close()

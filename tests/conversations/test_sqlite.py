"""The SQLite store: one WAL file, kept across restarts, shared by the processes of a host,
and bounded by its own puts."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from narwhal.conversations import sqlite as sqlite_module
from narwhal.conversations.record import StoredResponse
from narwhal.conversations.sqlite import SqliteStore

Turn = Callable[..., StoredResponse]
Chain = Callable[..., list[StoredResponse]]

# Another worker process of the host: it opens the file, prints the ids of the conversation
# named by argv[3] (if any) as read there, then stores argv[4] responses named argv[2]_<n>,
# a conversation continuing that one.
WORKER = """
import asyncio, sys
import orjson
from narwhal.conversations.record import StoredResponse
from narwhal.conversations.sqlite import SqliteStore

async def main(path, name, after_id, count):
    store = SqliteStore(path, max_stored=100_000, max_age_s=1e12)
    after = None
    if after_id:
        seen = await store.conversation(after_id, None)
        print(orjson.dumps([record.id for record in seen]).decode(), flush=True)
        after = seen[-1]
    for index in range(count):
        ancestors = (*after.ancestors, after.id) if after else ()
        after = StoredResponse(
            f"{name}_{index}", None, "m", 1000.0 + index, after.id if after else None,
            ancestors, b"[]", b"{}",
        )
        await store.put(after)
    await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


async def worker(path: Path, name: str, after_id: str, count: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", WORKER, str(path), name, after_id, str(count)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def finished(process: asyncio.subprocess.Process) -> bytes:
    stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    return stdout


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "responses.sqlite3"


async def test_the_file_is_in_wal_mode_with_retention_by_creation_time_indexed(
    path: Path,
) -> None:
    store = SqliteStore(path, max_stored=10, max_age_s=60.0)
    try:
        with sqlite3.connect(path) as other:
            assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            plan = other.execute(
                "EXPLAIN QUERY PLAN SELECT rowid FROM responses ORDER BY created_at LIMIT 5"
            ).fetchall()
        other.close()
        assert any("responses_by_age" in str(step) for step in plan), plan
        # NORMAL: a commit writes the log without flushing it.
        assert store._writes.execute("PRAGMA synchronous").fetchone() == (1,)
    finally:
        await store.close()


async def test_a_reopened_file_holds_what_was_stored(path: Path, chain: Chain) -> None:
    records = chain(4, tenant="acme")
    store = SqliteStore(path, max_stored=10, max_age_s=1e12)
    for record in records:
        await store.put(record)
    await store.close()
    await store.close()
    reopened = SqliteStore(path, max_stored=10, max_age_s=1e12)
    try:
        assert await reopened.conversation("resp_3", "acme") == records
    finally:
        await reopened.close()


async def test_missing_directories_of_the_path_are_created(tmp_path: Path, turn: Turn) -> None:
    path = tmp_path / "state" / "narwhal" / "responses.sqlite3"
    store = SqliteStore(path, max_stored=10, max_age_s=1e12)
    try:
        await store.put(turn("resp_a"))
        assert await store.get("resp_a", None) == turn("resp_a")
    finally:
        await store.close()
    assert path.is_file()


async def test_a_second_store_on_the_file_sees_each_write_at_once(path: Path, turn: Turn) -> None:
    first = SqliteStore(path, max_stored=10, max_age_s=1e12)
    second = SqliteStore(path, max_stored=10, max_age_s=1e12)
    try:
        for index in range(3):
            record = turn(f"resp_{index}")
            assert await second.get(record.id, None) is None
            await first.put(record)
            assert await second.get(record.id, None) == record
            assert await second.delete(record.id, None)
            assert await first.get(record.id, None) is None
    finally:
        await first.close()
        await second.close()


async def test_two_processes_share_the_file(path: Path, chain: Chain, turn: Turn) -> None:
    store = SqliteStore(path, max_stored=100_000, max_age_s=1e12)
    try:
        ours = chain(3, name="ours")
        for record in ours:
            await store.put(record)
        # The other process continues our conversation while this one keeps writing.
        other = asyncio.ensure_future(finished(await worker(path, "theirs", "ours_2", 400)))
        alone = 0
        while not other.done():
            await store.put(turn(f"alone_{alone}"))
            alone += 1
        read_there = orjson.loads(await other)
        assert read_there == ["ours_0", "ours_1", "ours_2"]
        whole = await store.conversation("theirs_399", None)
        assert [record.id for record in whole] == [
            *(f"ours_{index}" for index in range(3)),
            *(f"theirs_{index}" for index in range(400)),
        ]
        assert whole[:3] == ours
        assert store.count() == 3 + 400 + alone
        assert await store.get(f"alone_{alone - 1}", None) is not None
    finally:
        await store.close()


async def test_workers_starting_together_on_a_new_file_all_open_it(tmp_path: Path) -> None:
    path = tmp_path / "new" / "responses.sqlite3"
    workers = [await worker(path, f"worker{index}", "", 5) for index in range(4)]
    await asyncio.gather(*(finished(process) for process in workers))
    store = SqliteStore(path, max_stored=100, max_age_s=1e12)
    try:
        assert store.count() == 20
        assert len(await store.conversation("worker3_4", None)) == 5
    finally:
        await store.close()


async def test_puts_alone_keep_the_table_bounded(
    path: Path, turn: Turn, clock: Callable[[], float]
) -> None:
    store = SqliteStore(path, max_stored=10, max_age_s=1e12, clock=clock, prune_every=4)
    try:
        for index in range(42):
            await store.put(turn(f"resp_{index}", created_at=1000.0 + index))
        # The last pruning put was the 40th: it left 10, and two came after.
        assert store.count() == 12
        assert await store.get("resp_41", None) is not None
        assert await store.get("resp_30", None) is not None
        assert await store.get("resp_29", None) is None
    finally:
        await store.close()


async def test_puts_alone_remove_expired_rows(
    path: Path, turn: Turn, now: list[float], clock: Callable[[], float]
) -> None:
    store = SqliteStore(path, max_stored=100, max_age_s=60.0, clock=clock, prune_every=4)
    try:
        for index in range(6):
            await store.put(turn(f"old_{index}", created_at=1000.0))
        now[0] = 2000.0
        for index in range(2):
            await store.put(turn(f"new_{index}", created_at=2000.0))
        assert store.count() == 2
    finally:
        await store.close()


async def test_prune_removes_all_in_batches(
    path: Path,
    turn: Turn,
    now: list[float],
    clock: Callable[[], float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sqlite_module, "PRUNE_BATCH", 3)
    store = SqliteStore(path, max_stored=4, max_age_s=60.0, clock=clock)
    try:
        for index in range(10):
            await store.put(turn(f"old_{index}", created_at=1000.0))
        for index in range(10):
            await store.put(turn(f"new_{index}", created_at=1100.0 + index))
        now[0] = 1100.0
        assert store.count() == 20
        # The 10 expired, then the oldest 6 of the 10 live ones.
        assert await store.prune() == 16
        assert store.count() == 4
        assert [await store.get(f"new_{index}", None) is not None for index in range(10)] == [
            *([False] * 6),
            *([True] * 4),
        ]
    finally:
        await store.close()

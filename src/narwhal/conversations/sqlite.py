"""Stored responses in one SQLite file: the default store, shared by the workers of one host.

The file is in WAL mode, so that readers never wait for a writer and the workers of a host
(separate processes) share it; `synchronous=NORMAL` makes a commit a write to the log without
a flush to disk (a power cut may lose the last commits, never the file), and a busy timeout
makes a writer wait its turn behind another process's rather than fail. It is kept across
restarts.

Reads run inline on the event loop, on a connection of their own: they come from the page
cache and cost tens of microseconds (docs/responses.md has the figures), less than handing
them to a thread. Writes (`put`, `delete`, `prune`) run one at a time on a thread with the
other connection: a commit usually takes about 20 microseconds too, but a checkpoint of the
log flushes the file, a busy disk can hold a write for hundreds of milliseconds, and a
writer may wait for another process's lock, none of which may stall the loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson

from narwhal.conversations.record import NotStored, StoredResponse

# How long a writer waits for another connection's write lock before the call fails.
BUSY_TIMEOUT_S = 5.0
# `put` applies retention itself once in this many of a process's puts, a batch at most, so
# that the table stays bounded without a background loop.
PRUNE_EVERY = 256
# The most rows one statement of `prune` removes, so that other processes' writes interleave.
PRUNE_BATCH = 1000
# The most ids one `IN (...)` lookup binds (SQLite's own limit is far higher).
_LOOKUP_CHUNK = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY NOT NULL,
    tenant TEXT,
    model TEXT NOT NULL,
    created_at REAL NOT NULL,
    previous_id TEXT,
    ancestors TEXT NOT NULL,
    input BLOB NOT NULL,
    response BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""
_COLUMNS = "id, tenant, model, created_at, previous_id, ancestors, input, response"
_PUT = f"INSERT OR REPLACE INTO responses ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
_GET = f"SELECT {_COLUMNS} FROM responses WHERE id = ?"
_DELETE = "DELETE FROM responses WHERE id = ? AND tenant IS ? AND created_at >= ?"
_EXPIRED = (
    "DELETE FROM responses WHERE rowid IN "
    "(SELECT rowid FROM responses WHERE created_at < ? ORDER BY created_at LIMIT ?)"
)
_OLDEST = (
    "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses ORDER BY created_at LIMIT ?)"
)
_COUNT = "SELECT count(*) FROM responses"

T = TypeVar("T")


class SqliteStore:
    """A `ConversationStore` in the SQLite file at `path` (created, with its directories,
    when missing). Open it on the event loop's thread, which its reads use."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_stored: int,
        max_age_s: float,
        clock: Callable[[], float] = time.time,
        prune_every: int = PRUNE_EVERY,
    ) -> None:
        self.path = Path(path)
        self._max_stored = max_stored
        self._max_age_s = max_age_s
        self._clock = clock
        self._prune_every = prune_every
        self._puts = 0
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit on both: each statement is its own transaction. Every read is fetched
        # to its end, so that no half-read statement holds an old snapshot open.
        self._writes = _connect(self.path, check_same_thread=False)
        try:
            _set_up(self._writes)
            self._reads = _connect(self.path, check_same_thread=True)
        except BaseException:
            self._writes.close()
            raise
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="narwhal-responses")

    async def put(self, record: StoredResponse) -> None:
        row = (
            record.id,
            record.tenant,
            record.model,
            record.created_at,
            record.previous_id,
            orjson.dumps(record.ancestors).decode(),
            record.input,
            record.response,
        )
        self._puts += 1
        prune = self._puts % self._prune_every == 0
        await self._write(self._put, row, prune)

    async def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        rows = self._reads.execute(_GET, (response_id,)).fetchall()
        if not rows:
            return None
        record = _record(rows[0])
        return record if self._visible(record, tenant, self._clock()) else None

    async def conversation(self, response_id: str, tenant: str | None) -> list[StoredResponse]:
        now = self._clock()
        rows = self._reads.execute(_GET, (response_id,)).fetchall()
        last = _record(rows[0]) if rows else None
        if last is None or not self._visible(last, tenant, now):
            raise NotStored(response_id)
        found = {record.id: record for record in self._lookup(last.ancestors)}
        chain = []
        for ancestor in last.ancestors:
            record = found.get(ancestor)
            if record is None or not self._visible(record, tenant, now):
                raise NotStored(ancestor)
            chain.append(record)
        chain.append(last)
        return chain

    async def delete(self, response_id: str, tenant: str | None) -> bool:
        # Only the tenant's own, and not an expired one: that is as absent as any other.
        cutoff = self._clock() - self._max_age_s
        return await self._write(self._delete, response_id, tenant, cutoff)

    async def prune(self) -> int:
        removed = 0
        while batch := await self._write(self._prune_once, PRUNE_BATCH):
            removed += batch
        return removed

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._write(self._writes.close)
        self._writer.shutdown()
        self._reads.close()

    def count(self) -> int:
        """How many rows the file holds, expired ones included."""
        return int(self._reads.execute(_COUNT).fetchall()[0][0])

    async def _write(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._writer, call, *args)

    def _put(self, row: tuple[Any, ...], prune: bool) -> None:
        self._writes.execute(_PUT, row)
        if prune:
            # A bounded amount: several times what this process added since its last turn.
            self._prune_once(4 * self._prune_every)

    def _delete(self, response_id: str, tenant: str | None, cutoff: float) -> bool:
        return self._writes.execute(_DELETE, (response_id, tenant, cutoff)).rowcount > 0

    def _prune_once(self, limit: int) -> int:
        """Remove at most `limit` expired rows, then at most `limit` of the oldest beyond
        `max_stored`; how many went."""
        cutoff = self._clock() - self._max_age_s
        removed: int = self._writes.execute(_EXPIRED, (cutoff, limit)).rowcount
        excess = int(self._writes.execute(_COUNT).fetchall()[0][0]) - self._max_stored
        if excess > 0:
            removed += self._writes.execute(_OLDEST, (min(excess, limit),)).rowcount
        return removed

    def _lookup(self, ids: Sequence[str]) -> Iterator[StoredResponse]:
        for start in range(0, len(ids), _LOOKUP_CHUNK):
            chunk = ids[start : start + _LOOKUP_CHUNK]
            marks = ", ".join("?" * len(chunk))
            query = f"SELECT {_COLUMNS} FROM responses WHERE id IN ({marks})"
            for row in self._reads.execute(query, chunk).fetchall():
                yield _record(row)

    def _visible(self, record: StoredResponse, tenant: str | None, now: float) -> bool:
        return record.tenant == tenant and now - record.created_at <= self._max_age_s


def _connect(path: Path, *, check_same_thread: bool) -> sqlite3.Connection:
    db = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=check_same_thread
    )
    db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    return db


def _set_up(db: sqlite3.Connection) -> None:
    """WAL, and the table. WAL is a property of the file: once set, it stays (workers starting
    together on a new file wait for each other's setup through the busy timeout)."""
    mode = db.execute("PRAGMA journal_mode = WAL").fetchall()[0][0]
    if str(mode).lower() != "wal":
        raise sqlite3.OperationalError(f"journal_mode is {mode}, not wal")
    db.execute("PRAGMA synchronous = NORMAL")
    db.executescript(_SCHEMA)


def _record(row: Any) -> StoredResponse:
    id_, tenant, model, created_at, previous_id, ancestors, input_, response = row
    return StoredResponse(
        id=id_,
        tenant=tenant,
        model=model,
        created_at=created_at,
        previous_id=previous_id,
        ancestors=tuple(orjson.loads(ancestors)),
        input=input_,
        response=response,
    )

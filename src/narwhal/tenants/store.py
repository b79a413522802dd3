"""Where tenants' limit state lives: in this process, or in one file every worker maps.

A tenant's state is a `Row`: its requests bucket, its tokens bucket, and how many of its
requests each worker process has in flight. Every read-modify-write goes through
`LimitStore.apply`, which runs a change on the row atomically: whatever the change decides
(take from both buckets and count the request, or refuse and take nothing) is written
whole, or not at all.

- `LocalStore`: one router process. Rows in a list; the event loop is the only writer.
- `SharedStore`: `--workers N`. One file in the workers' run directory (tmpfs where there
  is one), mapped with `mmap` in every worker; each `apply` holds `fcntl.flock` on the file
  for its read-modify-write, so that N processes see one bucket per tenant and the limits
  hold for the whole router, not per worker.

The file's layout:

| part    | bytes                   | holds                                                 |
|---------|-------------------------|-------------------------------------------------------|
| header  | 64                      | magic (with the layout's version), workers, slots,    |
|         |                         |   slots used                                          |
| a slot  | 64 + 32 + 4 x workers,  | the tenant's name (UTF-8, NUL-padded; a longer one by |
|         |   rounded up to 8       |   its digest), requests level and stamp, tokens level |
|         |                         |   and stamp (doubles), in flight per worker (int32)   |

Slots are found by the tenant's name, not by its place in the file's `[[tenants]]`, so
that workers reloading a changed tenant list one after another (SIGHUP reaches each in
turn) agree on every tenant's row throughout; a name seen once keeps its slot for the
run. The first opener writes the header under the lock; an opener finding another layout
(another worker count, a stale or foreign file) writes it afresh. When every slot is
taken the file doubles, and each process maps the larger file the next time it looks a
name up. A new slot's buckets hold +inf, which the refill clips to the capacity: a tenant
starts full.

Opening the store as worker w zeroes w's in-flight counts in every row: a worker's process
opens it once, as it starts, with nothing in flight, so a replaced worker's dead
predecessor holds no place under a tenant's `max_concurrent`. `reset_worker(w)` does the
same from outside.

Stamps are compared across processes: callers pass a machine-wide clock
(`time.monotonic`).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from narwhal.tenants.buckets import UNUSED, UNUSED_LEVEL, Bucket

T = TypeVar("T")

MAGIC = b"NWTNL\x00\x00\x01"  # the last byte is the layout's version
HEADER = struct.Struct("<8sIII")  # magic, workers, slots, used
HEADER_BYTES = 64
NAME_BYTES = 64
# Slots in a fresh file; it doubles when they are all taken.
INITIAL_SLOTS = 16


def limits_path(run_dir: Path) -> Path:
    """Where the workers of one router keep their tenants' limits."""
    return run_dir / "tenant-limits"


@dataclass(slots=True)
class Row:
    """One tenant's limit state, as a change sees it and leaves it."""

    requests: Bucket
    tokens: Bucket
    # By worker number (one entry in a single process).
    in_flight: list[int]

    @property
    def total_in_flight(self) -> int:
        return sum(self.in_flight)


class LimitStore(Protocol):
    """Tenants' rows, each changed atomically."""

    @property
    def worker(self) -> int:
        """This process's worker number: its column of in-flight counts."""
        ...

    def slot(self, name: str) -> int:
        """The row of tenant `name`, found or made (a new one: buckets full, none in flight)."""
        ...

    def apply(self, slot: int, change: Callable[[Row], T]) -> T:
        """Run `change` on the row atomically (with every other process's changes) and keep
        what it left in the row; its result."""
        ...

    def read(self, slot: int) -> Row:
        """A copy of the row as it is now."""
        ...

    def reset_worker(self, worker: int) -> None:
        """Zero worker `worker`'s in-flight counts in every row (it is gone)."""
        ...

    def close(self) -> None: ...


class LocalStore:
    """The rows of one router process."""

    def __init__(self) -> None:
        self._rows: list[Row] = []
        self._slots: dict[str, int] = {}

    @property
    def worker(self) -> int:
        return 0

    def slot(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = len(self._rows)
            self._rows.append(Row(UNUSED, UNUSED, [0]))
        return slot

    def apply(self, slot: int, change: Callable[[Row], T]) -> T:
        # One event loop: nothing runs between the change's read and its write.
        return change(self._rows[slot])

    def read(self, slot: int) -> Row:
        row = self._rows[slot]
        return Row(row.requests, row.tokens, list(row.in_flight))

    def reset_worker(self, worker: int) -> None:
        for row in self._rows:
            row.in_flight[worker] = 0

    def close(self) -> None:
        pass


class SharedStore:
    """The rows of every worker of one router, in the file at `path`."""

    def __init__(self, path: Path, workers: int, worker: int) -> None:
        """Open (making or re-laying it out if needed) as worker `worker` of `workers`, and
        zero this worker's in-flight counts."""
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} is not one of {workers}")
        self.path = path
        self.workers = workers
        self._worker = worker
        self._data = struct.Struct(f"<4d{workers}i")
        self._row_bytes = -(-(NAME_BYTES + self._data.size) // 8) * 8
        self._slots: dict[str, int] = {}
        self._capacity = 0
        self._map: mmap.mmap | None = None
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._lock()
            try:
                if not self._laid_out():
                    self._lay_out()
                self._remap()
                self._zero(worker)
            finally:
                self._unlock()
        except BaseException:
            self.close()
            raise

    @property
    def worker(self) -> int:
        return self._worker

    def slot(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is not None:
            return slot
        key = _name_key(name)
        self._lock()
        try:
            self._remap()
            memory = self._memory()
            _, _, capacity, used = HEADER.unpack_from(memory, 0)
            for index in range(used):
                start = self._offset(index)
                if memory[start : start + NAME_BYTES] == key:
                    slot = index
                    break
            else:
                if used == capacity:
                    self._grow(capacity * 2)
                    memory = self._memory()
                slot = used
                start = self._offset(slot)
                memory[start : start + NAME_BYTES] = key
                self._data.pack_into(
                    memory,
                    start + NAME_BYTES,
                    UNUSED_LEVEL,
                    0.0,
                    UNUSED_LEVEL,
                    0.0,
                    *([0] * self.workers),
                )
                HEADER.pack_into(memory, 0, MAGIC, self.workers, self._capacity, used + 1)
        finally:
            self._unlock()
        self._slots[name] = slot
        return slot

    def apply(self, slot: int, change: Callable[[Row], T]) -> T:
        memory = self._memory()
        start = self._offset(slot) + NAME_BYTES
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            values = self._data.unpack_from(memory, start)
            row = Row(Bucket(values[0], values[1]), Bucket(values[2], values[3]), list(values[4:]))
            result = change(row)
            self._data.pack_into(
                memory,
                start,
                row.requests.level,
                row.requests.stamp,
                row.tokens.level,
                row.tokens.stamp,
                *row.in_flight,
            )
            return result
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self, slot: int) -> Row:
        memory = self._memory()
        start = self._offset(slot) + NAME_BYTES
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            values = self._data.unpack_from(memory, start)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return Row(Bucket(values[0], values[1]), Bucket(values[2], values[3]), list(values[4:]))

    def reset_worker(self, worker: int) -> None:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is not one of {self.workers}")
        self._lock()
        try:
            self._remap()
            self._zero(worker)
        finally:
            self._unlock()

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # The file, always under the lock.

    def _lock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _memory(self) -> mmap.mmap:
        if self._map is None:
            raise ValueError(f"{self.path}: the store is closed")
        return self._map

    def _offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * self._row_bytes

    def _laid_out(self) -> bool:
        """Whether the file holds this layout (this many workers, every slot present)."""
        size = os.fstat(self._fd).st_size
        if size < HEADER_BYTES:
            return False
        magic, workers, capacity, used = HEADER.unpack(os.pread(self._fd, HEADER.size, 0))
        return (
            magic == MAGIC
            and workers == self.workers
            and capacity > 0
            and used <= capacity
            and size >= self._offset(capacity)
        )

    def _lay_out(self) -> None:
        """Write a fresh header and empty slots over whatever the file held."""
        size = self._offset(INITIAL_SLOTS)
        os.ftruncate(self._fd, size)
        os.pwrite(self._fd, bytes(size), 0)
        os.pwrite(self._fd, HEADER.pack(MAGIC, self.workers, INITIAL_SLOTS, 0), 0)

    def _remap(self) -> None:
        """Map the whole file, if it grew since this process last mapped it."""
        _, _, capacity, _ = HEADER.unpack(os.pread(self._fd, HEADER.size, 0))
        if self._map is not None and capacity == self._capacity:
            return
        if self._map is not None:
            self._map.close()
        self._map = mmap.mmap(self._fd, self._offset(capacity))
        self._capacity = capacity

    def _grow(self, capacity: int) -> None:
        os.ftruncate(self._fd, self._offset(capacity))
        memory = self._memory()
        magic, workers, _, used = HEADER.unpack_from(memory, 0)
        HEADER.pack_into(memory, 0, magic, workers, capacity, used)
        self._remap()

    def _zero(self, worker: int) -> None:
        memory = self._memory()
        _, _, _, used = HEADER.unpack_from(memory, 0)
        for slot in range(used):
            struct.pack_into("<i", memory, self._offset(slot) + NAME_BYTES + 32 + 4 * worker, 0)


def _name_key(name: str) -> bytes:
    """A name as its slot holds it: its UTF-8, NUL-padded; a longer one as a digest behind
    a byte no UTF-8 text starts with, so that it never equals a short name."""
    raw = name.encode()
    if len(raw) > NAME_BYTES:
        raw = b"\xff" + hashlib.blake2b(raw, digest_size=32).digest()
    return raw.ljust(NAME_BYTES, b"\x00")

"""A per-minute limit as a token bucket (pure: every operation takes the clock as `now`).

A limit of L per minute is a bucket whose capacity is L, refilled continuously at L/60 per
second and starting full: what OpenAI's `x-ratelimit-*` headers describe. A bucket's state
is a `Bucket` (its level at its stamp); each operation first brings it up to `now`.

- `take` is all or nothing: n are taken only when the bucket holds n.
- `settle` corrects a reservation once its true cost is known: it gives back (n > 0) or
  charges (n < 0). A charge may leave the level below zero, a debt the refill pays off
  before anything more is taken; the level is never above capacity.
- A request costing more than the capacity can never be taken, however long it waits:
  `fits` says so, and `wait_s` is then infinite, so that a caller refuses it outright
  rather than tell a client to come back when it never could.

A level of +inf means "full, whatever the capacity": the refill clips it, so a bucket kept
by a store that never saw its capacity (a tenant added at runtime) starts full, and a
bucket whose capacity was lowered keeps its level clipped to the new one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

# A bucket never used: full, whatever its capacity turns out to be.
UNUSED_LEVEL = math.inf


class Bucket(NamedTuple):
    """A bucket's state: `level` as of `stamp` (a machine-wide monotonic clock)."""

    level: float
    stamp: float


UNUSED = Bucket(UNUSED_LEVEL, 0.0)


@dataclass(frozen=True, slots=True)
class Rate:
    """A limit of `per_minute` (> 0): the capacity, and the refill of per_minute/60 a second."""

    per_minute: float

    def __post_init__(self) -> None:
        if not (self.per_minute > 0 and math.isfinite(self.per_minute)):
            raise ValueError(f"a per-minute limit is a finite number > 0, not {self.per_minute}")

    @property
    def capacity(self) -> float:
        return self.per_minute

    @property
    def per_second(self) -> float:
        return self.per_minute / 60.0

    def full(self, now: float) -> Bucket:
        """A bucket as it starts: full."""
        return Bucket(self.per_minute, now)

    def refill(self, bucket: Bucket, now: float) -> Bucket:
        """`bucket` at `now`. A clock read before the stamp (another process's, a little
        behind) refills nothing and never moves the stamp back."""
        level, stamp = bucket
        elapsed = now - stamp
        if elapsed > 0:
            return Bucket(min(self.per_minute, level + elapsed * self.per_minute / 60.0), now)
        return Bucket(min(self.per_minute, level), stamp)

    def fits(self, n: float) -> bool:
        """Whether `n` can ever be taken (a full bucket holds it)."""
        return n <= self.per_minute

    def take(self, bucket: Bucket, n: float, now: float) -> Bucket | None:
        """The bucket less `n`, or None (and nothing taken) when it holds fewer than `n`."""
        current = self.refill(bucket, now)
        if current.level < n:
            return None
        return Bucket(current.level - n, current.stamp)

    def settle(self, bucket: Bucket, n: float, now: float) -> Bucket:
        """Give back `n` (a negative `n` charges more); never above capacity, possibly
        below zero."""
        level, stamp = self.refill(bucket, now)
        return Bucket(min(self.per_minute, level + n), stamp)

    def wait_s(self, bucket: Bucket, n: float, now: float) -> float:
        """Seconds from `now` until the bucket holds `n`: 0 if it does, inf if it never will."""
        level = self.refill(bucket, now).level
        if level >= n:
            return 0.0
        if not self.fits(n):
            return math.inf
        return (n - level) / self.per_second

    def full_in_s(self, bucket: Bucket, now: float) -> float:
        """Seconds from `now` until the bucket is full again (if nothing more is taken)."""
        return (self.per_minute - self.refill(bucket, now).level) / self.per_second


def retry_after(wait_s: float) -> int:
    """A wait as `Retry-After`: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait_s))


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's `x-ratelimit-reset-*` write it (Go's notation): "20ms",
    "1s", "1.5s", "1m30s", "6m0s", "1h0m0s"; rounded to the millisecond."""
    millis = round(seconds * 1000) if math.isfinite(seconds) else 0
    if millis <= 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    text = f"{whole}.{fraction:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text

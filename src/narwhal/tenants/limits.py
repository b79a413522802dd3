"""A tenant's admission against its limits, its settlement, and the headers that show them.

Each tenant's limits, as this router enforces them:

| limit                 | enforced as                                                     |
|-----------------------|-----------------------------------------------------------------|
| `max_concurrent`      | the tenant's requests between admission and end (queued ones    |
|                       |   included), counted in the store by worker; at the cap, 429    |
|                       |   with `Retry-After` = the tenant's recent mean request         |
|                       |   duration in this process (at least 1 s)                       |
| `requests_per_minute` | a bucket (`buckets.Rate`) from which each request takes 1       |
| `tokens_per_minute`   | a bucket from which each request takes its estimated tokens,    |
|                       |   settled on the engines' usage when it ends; a request costing |
|                       |   more than the whole bucket is refused outright, with          |
|                       |   `Retry-After` 60 (waiting would never let it in)              |

Checked in that order, all or nothing: a request refused by one limit takes nothing from
the others. A refusal is `RateLimited`, a `NarwhalError(429, code="rate_limit_exceeded")`
naming the tenant and the limit, with `Retry-After` the whole seconds until the bucket
holds what the request needs (at least 1).

With `server.replicas = R`, each replica enforces limit/R of every per-minute limit and
floor(max_concurrent / R), at least 1, of the concurrency cap (a cap below R would
otherwise shut the tenant out of a replica); with `--workers N` the store is shared
(`store.SharedStore`), so the workers of one replica enforce its share together. Every
tenant with a limit has its requests in flight counted in the store, so `state` shows the
router's count whichever limits it has.

A tenant with no limit at all never touches the store: admitting it is a dictionary look-up
and a count. A tenant the configuration does not name has no limits either.

`headers` right after `admit`, at the same `now`, reuses the buckets the admission saw
rather than visit the store again.

Runtime changes (`update`): new limits apply to the next request; a bucket keeps its level,
clipped to a lowered capacity; a new tenant (or a tenant's new limit) starts full. A tenant
removed and added again resumes its buckets as they refilled meanwhile.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from narwhal.config.tenants import TenantConfig
from narwhal.protocol.errors import Cause, NarwhalError
from narwhal.tenants.buckets import Bucket, Rate, duration_text, retry_after
from narwhal.tenants.store import LimitStore, Row

# How many of a tenant's last request durations the concurrency cap's Retry-After averages.
DURATIONS_KEPT: Final = 32
# Retry-After for a request that no bucket will ever hold: come back once a minute has
# passed (perhaps under new limits), rather than never.
NEVER_RETRY_AFTER_S: Final = 60
REQUESTS_HEADERS: Final = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
)
TOKENS_HEADERS: Final = (
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


class Limit(StrEnum):
    """Which limit refused a request (a bounded set, usable as a metrics label)."""

    MAX_CONCURRENT = "max_concurrent"
    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    TOO_LARGE = "request_too_large"


class RateLimited(NarwhalError):
    """A tenant's own limit refused the request: 429 `rate_limit_exceeded`."""

    def __init__(self, tenant: str, limit: Limit, message: str, retry_after_s: int) -> None:
        super().__init__(
            429,
            message,
            Cause.UNAVAILABLE,
            retry_after=retry_after_s,
            code="rate_limit_exceeded",
            refusal=limit.value,
        )
        self.tenant = tenant
        self.limit = limit


@dataclass(frozen=True, slots=True)
class TenantRule:
    """One tenant's limits as this router enforces them (its share of each)."""

    config: TenantConfig
    # The tenant's row in the store; None when it has no limit (it never touches the store).
    slot: int | None
    max_concurrent: int | None
    requests: Rate | None
    tokens: Rate | None


class _Tenant:
    """What this process keeps of a tenant: its rule, its requests here, recent durations,
    and its buckets as the last admission saw them (for that instant's headers)."""

    __slots__ = ("durations", "here", "rule", "seen", "seen_at")

    def __init__(self, rule: TenantRule) -> None:
        self.rule = rule
        self.here = 0
        self.durations: deque[float] = deque(maxlen=DURATIONS_KEPT)
        self.seen: tuple[Bucket, Bucket] | None = None
        self.seen_at = math.nan

    def mean_duration_s(self) -> float | None:
        return sum(self.durations) / len(self.durations) if self.durations else None


class Ticket:
    """What one admitted request took: settled once, released once."""

    __slots__ = (
        "_tenant",
        "admitted",
        "released",
        "reserved",
        "settled",
        "slot",
        "tenant",
        "tokens",
    )

    def __init__(
        self,
        tenant: str,
        tokens: int,
        admitted: float,
        slot: int | None = None,
        record: _Tenant | None = None,
        reserved: bool = False,
    ) -> None:
        self.tenant = tenant
        # The request's estimated tokens; `reserved`: taken from its tenant's tokens bucket.
        self.tokens = tokens
        self.reserved = reserved
        self.admitted = admitted
        # The store row whose in-flight count it holds; None: it holds none.
        self.slot = slot
        self.settled = False
        self.released = False
        self._tenant = record


class TenantLimits:
    """Every tenant's limits over one store (in-process, or shared by the workers)."""

    def __init__(self, configs: Iterable[TenantConfig], store: LimitStore, share: int = 1) -> None:
        """`share`: the router replicas (`server.replicas`) each taking 1/share of a limit."""
        if share < 1:
            raise ValueError(f"share must be at least 1, not {share}")
        self.store = store
        self.share = share
        self._tenants: dict[str, _Tenant] = {}
        self.update(configs)

    def update(self, configs: Iterable[TenantConfig], now: float | None = None) -> None:
        """The tenants and their limits from now on (the admin API, a reloaded file).

        A bucket whose limit changed keeps its level, clipped to the new capacity; given
        `now`, it is first refilled at the old rate up to `now` (without it, the time since
        its last use refills at the new rate)."""
        tenants: dict[str, _Tenant] = {}
        for config in configs:
            rule = self._rule(config)
            record = self._tenants.get(config.name)
            if record is None:
                record = _Tenant(rule)
            else:
                if rule.slot is not None and rule != record.rule:
                    self._carry(record.rule, rule, rule.slot, now)
                record.rule = rule
                record.seen = None
            tenants[config.name] = record
        self._tenants = tenants

    def _carry(self, old: TenantRule, new: TenantRule, slot: int, now: float | None) -> None:
        """A changed tenant's buckets into its new limits: refilled at the old rates up to
        `now` (if known), clipped to the new capacities."""

        def carry(row: Row) -> None:
            row.requests = _carried(old.requests, new.requests, row.requests, now)
            row.tokens = _carried(old.tokens, new.tokens, row.tokens, now)

        self.store.apply(slot, carry)

    def admit(self, tenant: str, tokens: int, now: float) -> Ticket:
        """Take one request of `tokens` estimated tokens from `tenant`'s limits, or raise
        `RateLimited` (a 429) having taken nothing."""
        record = self._tenants.get(tenant)
        if record is None:
            return Ticket(tenant, tokens, now, None, None)
        rule = record.rule
        slot = rule.slot
        if slot is None:
            record.here += 1
            return Ticket(tenant, tokens, now, None, record)
        if rule.tokens is not None and not rule.tokens.fits(tokens):
            raise self._too_large(rule, tokens)
        worker = self.store.worker

        def take(row: Row) -> tuple[Limit | None, float]:
            requests, token_bucket = row.requests, row.tokens
            if rule.requests is not None:
                requests = rule.requests.refill(requests, now)
            if rule.tokens is not None:
                token_bucket = rule.tokens.refill(token_bucket, now)
            record.seen, record.seen_at = (requests, token_bucket), now
            if rule.max_concurrent is not None and row.total_in_flight >= rule.max_concurrent:
                return Limit.MAX_CONCURRENT, 0.0
            if rule.requests is not None:
                if requests.level < 1:
                    return Limit.REQUESTS_PER_MINUTE, rule.requests.wait_s(requests, 1, now)
                requests = Bucket(requests.level - 1, requests.stamp)
            if rule.tokens is not None:
                if token_bucket.level < tokens:
                    return Limit.TOKENS_PER_MINUTE, rule.tokens.wait_s(token_bucket, tokens, now)
                token_bucket = Bucket(token_bucket.level - tokens, token_bucket.stamp)
            row.requests, row.tokens = requests, token_bucket
            row.in_flight[worker] += 1
            record.seen = (requests, token_bucket)
            return None, 0.0

        refused, wait_s = self.store.apply(slot, take)
        if refused is not None:
            raise self._refusal(record, refused, tokens, wait_s)
        record.here += 1
        return Ticket(tenant, tokens, now, slot, record, rule.tokens is not None)

    def settle(self, ticket: Ticket, actual_tokens: int, now: float) -> None:
        """Correct the tokens bucket by what the request really cost (actual less reserved),
        once; a later call changes nothing."""
        if ticket.settled:
            return
        ticket.settled = True
        record = self._tenants.get(ticket.tenant)
        if not ticket.reserved or record is None:
            return
        rate, slot = record.rule.tokens, record.rule.slot
        give = ticket.tokens - actual_tokens
        if rate is None or slot is None or give == 0:
            return

        def correct(row: Row) -> None:
            row.tokens = rate.settle(row.tokens, give, now)

        self.store.apply(slot, correct)
        record.seen = None

    def release(self, ticket: Ticket, now: float, duration_s: float | None = None) -> None:
        """The request ended: give back its place under `max_concurrent`, once; a later call
        changes nothing. `duration_s`: from its admission to its end, if not `now` less its
        admission."""
        if ticket.released:
            return
        ticket.released = True
        record = ticket._tenant
        if record is not None:
            record.here -= 1
            record.durations.append(now - ticket.admitted if duration_s is None else duration_s)
        if ticket.slot is not None:
            worker = self.store.worker

            def end(row: Row) -> None:
                row.in_flight[worker] = max(0, row.in_flight[worker] - 1)

            self.store.apply(ticket.slot, end)

    def headers(self, tenant: str, now: float) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for the per-minute limits `tenant` has (none:
        an empty dict). limit: this router's capacity; remaining: whole units in the
        bucket; reset: the time until it is full again."""
        record = self._tenants.get(tenant)
        if record is None:
            return {}
        rule = record.rule
        if rule.slot is None or (rule.requests is None and rule.tokens is None):
            return {}
        if record.seen is not None and record.seen_at == now:
            # The bucket as this instant's admission left it: no second visit to the store.
            requests, tokens = record.seen
        else:
            row = self.store.read(rule.slot)
            requests, tokens = row.requests, row.tokens
        headers: dict[str, str] = {}
        if rule.requests is not None:
            _describe(headers, REQUESTS_HEADERS, rule.requests, requests, now)
        if rule.tokens is not None:
            _describe(headers, TOKENS_HEADERS, rule.tokens, tokens, now)
        return headers

    def state(self, now: float) -> dict[str, Any]:
        """For `/narwhal/state`: each tenant's limits (as configured and as this router's
        share), its requests in flight (`in_flight`: the router's, counted in the store, for
        a tenant with limits; `in_flight_here`: this process's) and its buckets' levels."""
        tenants: dict[str, Any] = {}
        for name, record in self._tenants.items():
            rule = record.rule
            config = rule.config
            entry: dict[str, Any] = {
                "limits": {
                    "max_concurrent": config.max_concurrent,
                    "requests_per_minute": config.requests_per_minute,
                    "tokens_per_minute": config.tokens_per_minute,
                },
                "share": {
                    "max_concurrent": rule.max_concurrent,
                    "requests_per_minute": _per_minute(rule.requests),
                    "tokens_per_minute": _per_minute(rule.tokens),
                },
                "in_flight": None,
                "in_flight_here": record.here,
                "requests_level": None,
                "tokens_level": None,
                "mean_duration_s": record.mean_duration_s(),
            }
            if rule.slot is not None:
                row = self.store.read(rule.slot)
                entry["in_flight"] = row.total_in_flight
                entry["requests_level"] = _level(rule.requests, row.requests, now)
                entry["tokens_level"] = _level(rule.tokens, row.tokens, now)
            tenants[name] = entry
        return tenants

    def _rule(self, config: TenantConfig) -> TenantRule:
        if not config.limited:
            return TenantRule(config, None, None, None, None)
        share = self.share
        concurrent, requests, tokens = (
            config.max_concurrent,
            config.requests_per_minute,
            config.tokens_per_minute,
        )
        return TenantRule(
            config,
            self.store.slot(config.name),
            None if concurrent is None else max(1, concurrent // share),
            None if requests is None else Rate(requests / share),
            None if tokens is None else Rate(tokens / share),
        )

    def _too_large(self, rule: TenantRule, tokens: int) -> RateLimited:
        name = rule.config.name
        return RateLimited(
            name,
            Limit.TOO_LARGE,
            f"tenant `{name}`'s request needs {tokens} tokens (its prompt, estimated, plus "
            f"max_tokens), more than its whole tokens_per_minute "
            f"({self._shown(rule, Limit.TOKENS_PER_MINUTE)}) allows: it can never be "
            "admitted; lower max_tokens or shorten the prompt",
            NEVER_RETRY_AFTER_S,
        )

    def _refusal(self, record: _Tenant, limit: Limit, tokens: int, wait_s: float) -> RateLimited:
        rule = record.rule
        name = rule.config.name
        if limit is Limit.MAX_CONCURRENT:
            after = retry_after(record.mean_duration_s() or 1.0)
            return RateLimited(
                name,
                limit,
                f"tenant `{name}` has its max_concurrent ({self._shown(rule, limit)}) requests "
                f"in flight: retry in {after} s",
                after,
            )
        after = retry_after(wait_s)
        needs = f" for this request's {tokens} tokens" if limit is Limit.TOKENS_PER_MINUTE else ""
        return RateLimited(
            name,
            limit,
            f"tenant `{name}` is over its {limit.value} ({self._shown(rule, limit)}){needs}: "
            f"retry in {after} s",
            after,
        )

    def _shown(self, rule: TenantRule, limit: Limit) -> str:
        """A limit as configured, with this router's share of it when it is not the whole."""
        if limit is Limit.MAX_CONCURRENT:
            configured: float | None = rule.config.max_concurrent
            mine: float | None = rule.max_concurrent
        elif limit is Limit.REQUESTS_PER_MINUTE:
            configured, mine = rule.config.requests_per_minute, _per_minute(rule.requests)
        else:
            configured, mine = rule.config.tokens_per_minute, _per_minute(rule.tokens)
        if self.share == 1 or configured is None or mine is None:
            return f"{configured:g}" if configured is not None else "none"
        return f"{configured:g}, {mine:g} on each of {self.share} replicas"


def _carried(old: Rate | None, new: Rate | None, bucket: Bucket, now: float | None) -> Bucket:
    if new is None or old == new:
        return bucket
    if old is not None and now is not None:
        bucket = old.refill(bucket, now)
    return Bucket(min(bucket.level, new.capacity), bucket.stamp)


def _per_minute(rate: Rate | None) -> float | None:
    return None if rate is None else rate.per_minute


def _level(rate: Rate | None, bucket: Bucket, now: float) -> float | None:
    return None if rate is None else round(rate.refill(bucket, now).level, 3)


def _describe(
    headers: dict[str, str], keys: tuple[str, str, str], rate: Rate, bucket: Bucket, now: float
) -> None:
    level = rate.refill(bucket, now).level
    limit, remaining, reset = keys
    headers[limit] = str(math.floor(rate.capacity))
    headers[remaining] = str(max(0, math.floor(level)))
    headers[reset] = duration_text((rate.capacity - level) / rate.per_second)

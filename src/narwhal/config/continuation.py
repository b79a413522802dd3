"""`[continuation]`: whether a decode that fails after the 200 is carried on elsewhere.

Read with the rest of the configuration, so that `narwhal config validate` names a bad key
by its path. The request path's side of the feature is `narwhal.router.continuation`.
"""

from __future__ import annotations

from dataclasses import dataclass

from narwhal.config.table import Table


@dataclass(frozen=True, slots=True)
class ContinuationConfig:
    """`[continuation]` with its defaults (see docs/continuation.md)."""

    # Off by default: tracking keeps references to relayed bytes and reads them only after a
    # failure, but splicing out the ids still adds some 13 % to the router's CPU per
    # request, measured, over the 10 % that would make it the default (docs/continuation.md,
    # "Cost, and why it is off by default").
    enabled: bool = False
    # Continuations one request may use (each a fresh prefill, handoff and decode).
    max_attempts: int = 2
    # A token bucket shared by all requests, apart from the retry budget: credits at start,
    # and what each successful request earns back.
    budget: int = 50
    replenish: float = 0.2
    # Generated ids the router keeps per request to replay; an answer longer than this
    # that fails is ended with a terminal error instead.
    max_tracked_tokens: int = 32_768
    # Bytes of relayed events kept per request until it ends, to read its ids from should
    # its consumer fail; past this the answer is not continued either.
    max_tracked_bytes: int = 8 << 20


def parse_continuation(table: Table) -> ContinuationConfig:
    """Read `[continuation]`, recording each bad key's problem under its path."""
    d = ContinuationConfig()
    enabled = d.enabled
    raw = table.take("enabled", required=False)
    if isinstance(raw, bool):
        enabled = raw
    elif table.has("enabled"):
        table.fail("enabled", "must be true or false")
    config = ContinuationConfig(
        enabled=enabled,
        max_attempts=table.integer("max_attempts", d.max_attempts, 0),
        budget=table.integer("budget", d.budget, 0),
        replenish=table.number("replenish", d.replenish, zero_ok=True),
        max_tracked_tokens=table.integer("max_tracked_tokens", d.max_tracked_tokens, 1),
        max_tracked_bytes=table.integer("max_tracked_bytes", d.max_tracked_bytes, 1),
    )
    table.close()
    return config

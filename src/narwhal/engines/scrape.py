"""What an engine reports about itself in `/metrics`, read from vLLM's Prometheus text.

Only the series the router uses are read: the engine's own load (requests running and
waiting, KV-cache usage, and the time requests spent waiting in its queue, from the
`vllm:request_queue_time_seconds` histogram's sum and count) and where its prompt tokens
came from. vLLM 0.32 counts prompt
tokens by source in `vllm:prompt_tokens_by_source_total{source=...}`: `local_compute`
(computed here), `local_cache_hit` (found in its prefix cache) and `external_kv_transfer`
(pulled over the KV connector) — the one proof that a consumer used the blocks a producer
handed off, since the decode's usage reports no cached tokens for them. Series are summed
over their label sets (an engine with several data-parallel ranks reports one per rank).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import aiohttp

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source"
QUEUE_TIME_SUM = "vllm:request_queue_time_seconds_sum"
QUEUE_TIME_COUNT = "vllm:request_queue_time_seconds_count"
EXTERNAL = "external_kv_transfer"
LOCAL_COMPUTE = "local_compute"

_SOURCE = re.compile(r'source="([^"]*)"')
_WANTED = (
    RUNNING,
    WAITING,
    KV_CACHE_USAGE,
    PROMPT_TOKENS_BY_SOURCE,
    QUEUE_TIME_SUM,
    QUEUE_TIME_COUNT,
)


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One reading of an engine's `/metrics`; None (or no sources) where it publishes none."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prompt_tokens: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # Seconds requests waited in the engine's queue, summed, and how many were counted.
    queue_time_sum: float | None = None
    queue_time_count: float | None = None

    @property
    def counts_sources(self) -> bool:
        """Whether the engine says where its prompt tokens came from."""
        return bool(self.prompt_tokens)


def parse_report(text: bytes) -> EngineReport:
    """Read the series the router uses from Prometheus text; anything else is skipped."""
    sums: dict[str, float] = {}
    sources: dict[str, float] = {}
    for raw in text.splitlines():
        if not raw.startswith(b"vllm:"):
            continue
        line = raw.decode("utf-8", "replace")
        name, labels, value = _sample(line)
        if name is None or value is None:
            continue
        if name == PROMPT_TOKENS_BY_SOURCE:
            match = _SOURCE.search(labels)
            if match is not None:
                sources[match.group(1)] = sources.get(match.group(1), 0.0) + value
        else:
            sums[name] = sums.get(name, 0.0) + value
    return EngineReport(
        running=sums.get(RUNNING),
        waiting=sums.get(WAITING),
        kv_cache_usage=sums.get(KV_CACHE_USAGE),
        prompt_tokens=MappingProxyType(sources),
        queue_time_sum=sums.get(QUEUE_TIME_SUM),
        queue_time_count=sums.get(QUEUE_TIME_COUNT),
    )


async def read_report(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> EngineReport | None:
    """One reading of the engine at `url`, or None when its `/metrics` cannot be read."""
    try:
        async with asyncio.timeout(timeout_s), session.get(url + "/metrics") as response:
            if response.status != 200:
                return None
            return parse_report(await response.read())
    except (TimeoutError, aiohttp.ClientError):
        return None


def _sample(line: str) -> tuple[str | None, str, float | None]:
    """(series name without `_total`, label text, value) of one wanted sample line."""
    brace = line.find("{")
    if brace >= 0:
        name, rest = line[:brace], line[brace:]
        close = rest.rfind("}")
        labels, tail = rest[: close + 1], rest[close + 1 :]
    else:
        name, _, tail = line.partition(" ")
        labels = ""
    name = name.removesuffix("_total")
    if name not in _WANTED:
        return None, "", None
    parts = tail.split()
    try:
        value = float(parts[0]) if parts else math.nan
    except ValueError:
        return name, labels, None
    return name, labels, value if math.isfinite(value) else None


def moved(before: EngineReport, after: EngineReport, source: str) -> float:
    """How many prompt tokens of `source` the engine counted between two readings (a
    restarted engine's counters start again from zero)."""
    old, new = before.prompt_tokens.get(source, 0.0), after.prompt_tokens.get(source, 0.0)
    return new - old if new >= old else new

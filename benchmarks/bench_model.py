"""What a benchmark run is asked to do and what it measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_load import BatchResult

SHAPES = {"short": 64, "long": 1024, "mixed-nonstream": 256}
"""Output tokens per request for each shape (the mix varies them per request)."""
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """One benchmark run; the defaults are the 64-streams x 256-tokens comparison."""

    shape: str = "stream"
    max_tokens: int = DEFAULT_MAX_TOKENS
    concurrency: int = 64
    requests: int = 2048
    trials: int = 3
    inter_token_s: float = 0.0
    prefill_s_per_token: float = 0.0
    direct: bool = True
    narwhal: bool = True
    vllm_router: Path | None = None
    fastapi_proxy: Path | None = None
    targets: tuple[tuple[str, str], ...] = ()
    target_pids: tuple[tuple[str, int], ...] = ()
    producer_port: int = 0
    consumer_port: int = 0
    load_processes: int = 1
    warmup: bool = True
    quiet: bool = False
    # Also run Narwhal with tracing on ("narwhal-traced"), exporting to an OTLP sink.
    tracing: bool = False
    tracing_ratio: float = 1.0
    # Also run Narwhal once per optional feature, flipped from its default (bench_matrix).
    matrix: bool = False
    # Narwhal's `engine.nonstream_decode`: "stream", "whole", or "both" (a second target,
    # "narwhal-whole", in the same interleaved run).
    nonstream_decode: str = "stream"


@dataclass(slots=True)
class Party:
    """A target as measured over all its batches."""

    name: str
    results: list[BatchResult] = field(default_factory=list)
    router_cpu_s: float | None = None
    rss_bytes: int | None = None
    producer_cpu_s: float = 0.0
    consumer_cpu_s: float = 0.0

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.results)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.results)

    @property
    def load_cpu_s(self) -> float:
        return sum(r.cpu_s for r in self.results)


@dataclass(frozen=True, slots=True)
class Summary:
    """One target's figures; latencies in seconds, `None` where a figure does not apply."""

    name: str
    requests: int
    errors: int
    tokens: int
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float | None
    itl_p99_s: float | None
    tpot_p50_s: float | None
    added_ttft_p50_s: float | None
    added_ttft_p99_s: float | None
    added_tpot_p50_s: float | None
    router_cpu_s: float | None
    router_cpu_s_per_1k_requests: float | None
    router_cpu_s_per_1k_tokens: float | None
    router_rss_bytes: int | None
    load_cpu_percent: float
    load_cpu_s_per_1k_tokens: float
    producer_cpu_percent: float
    consumer_cpu_percent: float
    consumer_cpu_s_per_1k_tokens: float
    error_samples: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BenchReport:
    options: BenchOptions
    summaries: tuple[Summary, ...]
    batches: tuple[dict[str, Any], ...]

    def summary(self, name: str) -> Summary:
        return next(s for s in self.summaries if s.name == name)

"""A benchmark run's figures as tables, JSON and a chart."""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from pathlib import Path

import orjson
from bench_model import BenchReport


def _ms(seconds: float | None, signed: bool = False) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1000:+.2f}" if signed else f"{seconds * 1000:.2f}"


def _us(seconds: float | None, signed: bool = False) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1e6:+.1f}" if signed else f"{seconds * 1e6:.1f}"


def _mib(size: int | None) -> str:
    return "n/a" if size is None else f"{size / 2**20:.1f} MiB"


def number(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_report(report: BenchReport) -> str:
    """The tables: throughput and latency, then what each party spent."""
    o = report.options
    shape = o.shape if o.shape != "stream" else f"streaming, {o.max_tokens} tokens"
    head = (
        f"{o.concurrency} concurrent clients, {o.requests} requests per batch, "
        f"{o.trials} interleaved trials, {shape}, inter-token {o.inter_token_s:g} s, "
        f"{os.cpu_count()} cores"
    )
    latency = [
        f"{'':<14}{'':>9}{'':>10}{'TTFT ms':>20}{'+TTFT ms':>16}{'per token µs':>30}",
        f"{'target':<14}{'req/s':>9}{'tok/s':>10}{'p50':>10}{'p99':>10}{'p50':>8}{'p99':>8}"
        f"{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}{'+TPOT':>8}{'errors':>8}",
    ]
    for s in report.summaries:
        latency.append(
            f"{s.name:<14}{s.requests_per_s:>9.1f}{s.tokens_per_s:>10,.0f}"
            f"{_ms(s.ttft_p50_s):>10}{_ms(s.ttft_p99_s):>10}"
            f"{_ms(s.added_ttft_p50_s, True):>8}{_ms(s.added_ttft_p99_s, True):>8}"
            f"{_us(s.itl_p50_s):>9}{_us(s.itl_p99_s):>9}{_us(s.tpot_p50_s):>10}"
            f"{_us(s.added_tpot_p50_s, True):>8}{s.errors:>8}"
        )
    cost = [
        f"{'':<14}{'router CPU seconds':>31}{'':>12}{'load':>16}{'engines (consumer /1k tok)':>32}",
        f"{'target':<14}{'total':>8}{'/1k req':>10}{'/1k tok':>13}{'router RSS':>12}"
        f"{'CPU':>6}{'/1k tok':>10}{'producer':>10}{'consumer':>10}{'/1k tok':>12}",
    ]
    for s in report.summaries:
        cost.append(
            f"{s.name:<14}{number(s.router_cpu_s, 2):>8}"
            f"{number(s.router_cpu_s_per_1k_requests):>10}"
            f"{number(s.router_cpu_s_per_1k_tokens, 5):>13}{_mib(s.router_rss_bytes):>12}"
            f"{s.load_cpu_percent:>5.0f}%{s.load_cpu_s_per_1k_tokens:>10.5f}"
            f"{s.producer_cpu_percent:>9.0f}%{s.consumer_cpu_percent:>9.0f}%"
            f"{s.consumer_cpu_s_per_1k_tokens:>12.5f}"
        )
    notes = [
        "+ columns: added over the direct path. ITL: gaps between token events as the client "
        "reads them; TPOT: each request's mean time per output token.",
        "CPU: user+system from /proc over each batch; load, producer and consumer CPU as a "
        "percentage of one core; RSS: the router's largest after a batch.",
    ]
    errors = [f"{s.name} error: {sample}" for s in report.summaries for sample in s.error_samples]
    return "\n".join([head, "", *latency, "", *cost, "", *notes, *errors])


def report_json(report: BenchReport) -> bytes:
    document = {
        "options": asdict(report.options),
        "targets": [asdict(summary) for summary in report.summaries],
        "batches": list(report.batches),
        "cpu_count": os.cpu_count(),
    }
    return orjson.dumps(document, option=orjson.OPT_INDENT_2, default=str)


def plot(report: BenchReport, path: Path) -> str:
    """A latency/throughput chart per batch, and the router CPU per token; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for index, s in enumerate(report.summaries):
        rows = [b for b in report.batches if b["target"] == s.name]
        throughput = [b["tokens_per_s"] for b in rows]
        color = f"C{index}"
        p50 = [b["ttft_p50_s"] * 1000 for b in rows]
        p99 = [b["ttft_p99_s"] * 1000 for b in rows]
        left.scatter(throughput, p50, color=color, label=f"{s.name} TTFT p50")
        left.scatter(throughput, p99, color=color, marker="x", label=f"{s.name} TTFT p99")
    left.set_xlabel("tokens/s relayed (one point per batch)")
    left.set_ylabel("client TTFT (ms)")
    left.legend(fontsize="small")
    costs = [s for s in report.summaries if s.router_cpu_s_per_1k_tokens is not None]
    right.bar([s.name for s in costs], [s.router_cpu_s_per_1k_tokens or 0.0 for s in costs])
    right.set_ylabel("router CPU s per 1,000 tokens")
    figure.suptitle(
        f"{report.options.concurrency} clients, {report.options.shape}, "
        f"{report.options.max_tokens} tokens"
    )
    figure.tight_layout()
    figure.savefig(path)
    return f"plot written to {path}"

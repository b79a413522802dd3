"""One real fleet for the session: a prefill and a decode vLLM engine (a second decode
engine under `make real-continuation`), and a router.

The engines take about a minute to start, so every test shares them; they are stopped at
the end of the session whatever happened. Timings and memory go to the terminal summary.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.tools.vllm_fleet import VllmFleet, VllmOptions
from support.real import (
    CONTINUATION,
    FIGURES,
    KV_LEASE_S,
    MODEL,
    REASONING_PARSER,
    ROOT,
    TINY_MODEL,
    VLLM_PYTHON,
    RealStack,
)

LOG_DIR = ROOT / ".cache" / "real-logs"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def real() -> AsyncIterator[RealStack]:
    if not VLLM_PYTHON.exists() or not (TINY_MODEL / ".built").exists():
        pytest.fail("no .venv-vllm or tiny model: run `make real` (or `make tiny-model` first)")
    shutil.rmtree(LOG_DIR, ignore_errors=True)
    options = VllmOptions(
        python=VLLM_PYTHON,
        model=TINY_MODEL,
        served_model_name=MODEL,
        log_dir=LOG_DIR,
        extra_args=("--reasoning-parser", REASONING_PARSER),
        kv_lease_duration_s=KV_LEASE_S,
    )
    started = time.monotonic()
    roles = [("p0", "prefill"), ("d0", "decode")] + ([("d1", "decode")] if CONTINUATION else [])
    async with VllmFleet(options, roles) as fleet:
        FIGURES["engines started together"] = f"{time.monotonic() - started:.1f} s"
        for engine in fleet:
            FIGURES[f"{engine.name} memory (PSS)"] = f"{engine.memory_mib():.0f} MiB"
        journal_path = LOG_DIR / "journal.jsonl"
        whole_journal_path = LOG_DIR / "journal-whole.jsonl"
        settings: dict[str, Any] = {
            "model": MODEL,
            # A CPU engine on a busy 2-core machine: slow first tokens are not faults here.
            "engine": {
                "first_token_timeout_s": 60.0,
                "decode_read_timeout_s": 60.0,
                # Each /metrics read costs a CPU engine's API server real work.
                "metrics_interval_s": 2.0,
                "kv_lease_s": KV_LEASE_S,
            },
            # A prefill that waited past the handoff bound is tried afresh, as a fleet
            # on a shared CPU needs: the router's retry, not the test's.
            "serving": {"max_attempts": 2},
            # d1 lets an answer whose consumer dies go on (tests/real/test_continuation.py).
            "continuation": {"enabled": CONTINUATION},
            "engines": [{"id": e.name, "url": e.url, "role": e.role} for e in fleet],
        }
        config = parse_config(
            {**settings, "journal": {"path": str(journal_path)}}, source="tests/real"
        )
        # The same fleet behind a router whose non-streaming decodes are asked for whole
        # (tests/real/test_whole_answers.py); it leaves reading /metrics to the first.
        whole_config = parse_config(
            {
                **settings,
                "journal": {"path": str(whole_journal_path)},
                "engine": {
                    **settings["engine"],
                    "metrics_interval_s": 0,
                    "nonstream_decode": "whole",
                },
            },
            source="tests/real (whole answers)",
        )
        server = RouterServer(config, port=0)
        whole = RouterServer(whole_config, port=0)
        await server.start()
        await whole.start()
        try:
            yield RealStack(fleet, server, journal_path, whole, whole_journal_path)
        finally:
            await whole.stop()
            await server.stop()
    FIGURES["engine logs"] = str(LOG_DIR)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.write_sep("-", "real vLLM fleet")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")
    journal = LOG_DIR / "journal.jsonl"
    if terminalreporter.stats.get("failed") and journal.exists():
        # What the router saw go differently, so that a failure on a machine whose logs
        # are gone can still be explained: retries, fallbacks, errors, engine events.
        terminalreporter.write_sep("-", "router journal: the unusual lines")
        for line in journal.read_text().splitlines()[-400:]:
            entry = json.loads(line)
            usual = (
                entry.get("type") == "request"
                and entry.get("outcome") == "ok"
                and entry.get("attempts") == 1
                and entry.get("handoff") == "crossed"
            )
            if not usual:
                terminalreporter.write_line(line[:600])

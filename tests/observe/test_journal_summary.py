"""The journal summary reads request and engine lines and survives a torn journal."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from narwhal.observe.journal_summary import read_summary, render, summarize_command


def request(status: int, outcome: str, **fields: object) -> bytes:
    line = {"type": "request", "ts": 1_800_000_000.0, "status": status, "outcome": outcome}
    return orjson.dumps({**line, **fields})


def test_a_summary_counts_requests_latencies_retries_and_engines() -> None:
    lines = [
        *(
            request(200, "ok", ttft_s=0.01 * i, first_byte_s=0.02 * i, handoff="crossed")
            for i in range(1, 101)
        ),
        request(
            502,
            "error",
            cause="silence",
            attempts=2,
            retry_denied=True,
            failures=[
                {"engine": "d0", "cause": "closed_early", "status": 502},
                {"engine": "d1", "cause": "silence", "status": 504},
            ],
        ),
        orjson.dumps({"type": "engine", "ts": 1_800_000_060.0, "event": "ejected", "engine": "d1"}),
        orjson.dumps({"type": "engine", "event": "probe", "engine": "d1", "result": "failure"}),
        b'{"type": "request", "status": 20',  # cut off by a crash
        b"",
    ]
    text = render(read_summary(lines))
    assert "from 2027-01-15 08:00:00 UTC to 2027-01-15 08:01:00 UTC (60 s)" in text
    assert "requests: 101" in text
    assert "by outcome: ok 100, error 1" in text
    assert "failure causes: silence 1" in text
    assert "ttft            100    500 ms    900 ms    990 ms" in text
    assert "first byte      100    1.00 s    1.80 s    1.98 s" in text
    assert "retries: 1 over 1 requests; 1 denied by the retry budget" in text
    assert "handoffs: crossed 100" in text
    assert "  d0\n    failures: closed_early 1\n" in text
    assert "  d1\n    failures: silence 1\n    state changes: ejected 1, probe failure 1" in text
    assert "skipped 1 lines that are not journal entries" in text


def test_summarize_command_reports_an_unreadable_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert summarize_command(tmp_path / "missing.jsonl") == 2
    assert "cannot read the journal" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert summarize_command(empty) == 0
    assert "requests: 0" in capsys.readouterr().out

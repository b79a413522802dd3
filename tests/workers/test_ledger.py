"""A worker's ledger: what it was serving can be read back after it is killed."""

from __future__ import annotations

from pathlib import Path

import pytest

import narwhal.workers.ledger as ledger_module
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call
from narwhal.workers.ledger import Ledger, unfinished


def call(request_id: str) -> Call:
    return Call(
        request_id=request_id,
        client_request_id=None,
        endpoint=Endpoint.CHAT,
        arrival=0.0,
        deadline=1.0,
    )


def test_requests_opened_and_never_closed_are_unfinished(tmp_path: Path) -> None:
    path = tmp_path / "w.ledger"
    ledger = Ledger(path)
    calls = [call(f"r{i}") for i in range(4)]
    for each in calls:
        ledger.opened(each)
    ledger.closed(calls[1], 0.0)
    ledger.closed(calls[3], 0.0)
    ledger.closed(calls[3], 0.0)
    # As a killed process leaves it: no close, maybe a torn last line.
    with path.open("ab") as handle:
        handle.write(b'{"close": "r0"')
    assert [entry["open"] for entry in unfinished(path)] == ["r0", "r2"]
    assert unfinished(path)[0]["endpoint"] == "/v1/chat/completions"


def test_compaction_keeps_only_open_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.ledger"
    monkeypatch.setattr(ledger_module, "COMPACT_BYTES", 2000)
    ledger = Ledger(path)
    ledger.opened(call("kept"))
    for i in range(100):
        ledger.opened(call(f"done{i}"))
        ledger.closed(call(f"done{i}"), 0.0)
    assert path.stat().st_size < 2000
    assert [entry["open"] for entry in unfinished(path)] == ["kept"]
    ledger.closed(call("kept"), 0.0)
    assert unfinished(path) == []


def test_no_ledger_means_nothing_unfinished(tmp_path: Path) -> None:
    assert unfinished(tmp_path / "absent") == []

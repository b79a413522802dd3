"""Engine events as journal lines, each naming its engine's model."""

from __future__ import annotations

from typing import Any

from narwhal.config.root import parse_config
from narwhal.fleet.events import EngineEvent
from narwhal.fleet.table import Fleet
from narwhal.observe.events import EngineLines, engine_entry


async def test_engine_lines_name_the_engines_model_even_once_it_is_removed() -> None:
    config = parse_config(
        {
            "model": "model-a",
            "engines": [
                {"id": "pa", "url": "http://127.0.0.1:1", "role": "prefill"},
                {"id": "db", "url": "http://127.0.0.1:2", "role": "decode", "model": "model-b"},
            ],
        },
        source="test",
    )
    fleet = Fleet(config.engines)
    fleet.by_id["pa"].model = "model-a"
    lines: list[dict[str, Any]] = []
    fleet.listeners.append(EngineLines(fleet, lines.append))
    fleet.emit(EngineEvent("quarantined", "db", "5 s after silence"))
    db = fleet.by_id["db"]
    fleet.drain(db, "operator")
    fleet.remove(db, "operator")
    # An event of an engine the fleet never had names no model.
    fleet.emit(EngineEvent("probe", "zz", result="failure"))
    assert [(line["event"], line["engine"], line["model"]) for line in lines] == [
        ("quarantined", "db", "model-b"),
        ("draining", "db", "model-b"),
        ("drained", "db", "model-b"),
        ("removed", "db", "model-b"),
        ("probe", "zz", None),
    ]


def test_an_engine_line_without_a_model_says_none() -> None:
    entry = engine_entry(EngineEvent("ejected", "d0", "3 failures"))
    assert entry["type"] == "engine" and entry["model"] is None

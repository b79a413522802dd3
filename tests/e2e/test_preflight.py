"""Preflight: the contract on every engine and real transfers, in-process and from the CLI."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from narwhal.config.root import Config, parse_config
from narwhal.fleet.preflight import format_report, run_preflight, transfer_pairs
from narwhal.tools.sim.faults import Fault
from narwhal.tools.sim.fleet import SimFleet
from support.stack import CONTRACT, FAST, MODEL, serve_process

ROLES = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))


def fleet_config(fleet: SimFleet, roles: Any = ROLES, **sections: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        **sections,
        "engines": [
            {"id": n, "url": e.url, "role": r, "identity_url": e.url + "/sim/identity"}
            for (n, r), e in zip(roles, fleet.engines, strict=True)
        ],
    }


def specs(*roles: tuple[str, str]) -> Config:
    return parse_config(
        {
            "model": MODEL,
            "engines": [
                {"id": n, "url": f"http://127.0.0.1:{9000 + i}", "role": r}
                for i, (n, r) in enumerate(roles)
            ],
        }
    )


def names(pairs: list[Any]) -> list[tuple[str, str]]:
    return [(p.id, c.id) for p, c in pairs]


def test_the_default_cover_pairs_every_producer_and_every_consumer() -> None:
    config = specs(
        ("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"), ("d2", "decode")
    )
    pairs = names(transfer_pairs(config, mesh=False))
    assert {p for p, _ in pairs} == {"p0", "p1"}
    assert {c for _, c in pairs} == {"d0", "d1", "d2"}
    assert len(pairs) == 3


def test_mesh_probes_every_ordered_pair_of_distinct_engines() -> None:
    config = specs(("b0", "both"), ("b1", "both"), ("d0", "decode"))
    assert sorted(names(transfer_pairs(config, mesh=True))) == [
        ("b0", "b1"),
        ("b0", "d0"),
        ("b1", "b0"),
        ("b1", "d0"),
    ]


def test_a_lone_both_engine_pairs_with_itself() -> None:
    assert names(transfer_pairs(specs(("b0", "both")), mesh=False)) == [("b0", "b0")]


def sim_options(*names_: str) -> list[Any]:
    return [replace(FAST, name=n) for n in names_]


async def test_a_healthy_fleet_passes_every_check() -> None:
    async with SimFleet(sim_options("p0", "p1", "d0")) as fleet:
        config = parse_config(fleet_config(fleet, engine_contract=CONTRACT))
        rows = await run_preflight(config, mesh=True)
    assert all(row.ok for row in rows), format_report(rows)
    assert [r.subject for r in rows if r.kind == "transfer"] == ["p0 -> d0", "p1 -> d0"]
    assert "5/5 checks passed" in format_report(rows)


async def test_a_contract_pinning_only_the_version_checks_only_the_version() -> None:
    options = sim_options("p0", "p1", "d0")
    # A field that is not pinned may differ: only engine_version is compared.
    options[1] = replace(options[1], block_size=32)
    async with SimFleet(options) as fleet:
        contract = {"engine_version": CONTRACT["engine_version"]}
        config = parse_config(fleet_config(fleet, engine_contract=contract))
        rows = await run_preflight(config)
    assert all(row.ok for row in rows), format_report(rows)
    details = {row.subject: row.detail for row in rows}
    assert details["p1"] == "healthy, meets the contract (pinned: engine_version)"


async def test_a_pinned_tp_size_is_checked_on_the_transfer_descriptor() -> None:
    async with SimFleet(sim_options("p0", "p1", "d0")) as fleet:
        contract = {"engine_version": CONTRACT["engine_version"], "tp_size": 2}
        data = fleet_config(fleet, engine_contract=contract)
        for entry in data["engines"]:
            del entry["identity_url"]  # so that only a handoff shows tp_size, as with vLLM
        rows = await run_preflight(parse_config(data))
    details = {row.subject: row.detail for row in rows if not row.ok}
    assert details == {
        "p0 -> d0": "tp_size: expected 2, descriptor says 1",
        "p1 -> d0": "tp_size: expected 2, descriptor says 1",
    }


async def test_a_contract_mismatch_names_the_engine_and_field() -> None:
    options = sim_options("p0", "p1", "d0")
    options[1] = replace(options[1], block_size=32)
    async with SimFleet(options) as fleet:
        config = parse_config(fleet_config(fleet, engine_contract=CONTRACT))
        rows = await run_preflight(config)
    failed = {row.subject: row.detail for row in rows if not row.ok}
    assert failed["p1"] == "block_size: expected 16, got 32"
    assert failed["p1 -> d0"] == "skipped: p1 failed"
    assert set(failed) == {"p1", "p1 -> d0"}


async def test_a_broken_transfer_fails_its_row() -> None:
    async with SimFleet(sim_options("p0", "p1", "d0")) as fleet:
        fleet.engines[2].set_fault(Fault.from_json({"phase": "decode", "kv_pull_fail": True}))
        rows = await run_preflight(parse_config(fleet_config(fleet)))
    transfers = [row for row in rows if row.kind == "transfer"]
    assert transfers and not any(row.ok for row in transfers)
    assert "engine d0 reported an error" in transfers[0].detail


async def _run_cli(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "narwhal",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, output.decode()


def _toml(config: dict[str, Any]) -> str:
    lines = [f'model = "{config["model"]}"', "[engine_contract]"]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in CONTRACT.items()]
    for engine in config["engines"]:
        lines.append("[[engines]]")
        lines += [f'{k} = "{v}"' for k, v in engine.items()]
    return "\n".join(lines) + "\n"


async def test_the_check_command_prints_the_table_and_sets_the_exit_status(
    tmp_path: Path,
) -> None:
    options = sim_options("p0", "p1", "d0")
    async with SimFleet(options) as fleet:
        path = tmp_path / "fleet.toml"
        path.write_text(_toml(fleet_config(fleet)))
        status, output = await _run_cli("check", "--config", str(path))
        assert status == 0, output
        assert "checks passed" in output and "p0 -> d0" in output
        fleet.engines[2].options = replace(fleet.engines[2].options, version="0.10.1")
        status, output = await _run_cli("check", "--config", str(path))
        assert status == 1
        assert 'engine_version: expected "0.11.0", got "0.10.1"' in output.replace("'", '"')


async def test_serve_refuses_to_start_when_preflight_fails(tmp_path: Path) -> None:
    options = sim_options("p0", "p1", "d0")
    options[2] = replace(options[2], tp_size=2)
    async with SimFleet(options) as fleet:
        path = tmp_path / "fleet.toml"
        path.write_text(_toml(fleet_config(fleet)))
        status, output = await _run_cli("serve", "--config", str(path), "--port", "0")
        assert status == 1
        assert "d0" in output and "tp_size: expected 1, got 2" in output
        assert "preflight failed; not serving" in output


async def test_serve_starts_with_only_a_short_request_deadline_set(tmp_path: Path) -> None:
    # Unset timeouts that would exceed the deadline are clamped to it, not refused.
    async with SimFleet(sim_options("p0", "p1", "d0")) as fleet:
        path = tmp_path / "fleet.json"
        data = {**fleet_config(fleet), "serving": {"request_timeout_s": 2.5}}
        path.write_text(json.dumps(data))
        async with (
            serve_process(path, tmp_path / "serve.log") as (process, url),
            aiohttp.ClientSession() as http,
            http.get(url + "/health") as response,
        ):
            assert response.status == 200 and process.returncode is None

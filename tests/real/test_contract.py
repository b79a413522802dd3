"""`narwhal check` against real vLLM: a contract pinning what vLLM 0.32 really publishes
passes, and a crossed transfer counts only when the consumer's metrics show pulled KV."""

from __future__ import annotations

import pytest

from narwhal.config.root import parse_config
from narwhal.fleet.preflight import format_report, run_preflight
from support.real import MODEL, RealStack

pytestmark = pytest.mark.asyncio(loop_scope="session")

# What vLLM 0.32's CPU build is, as the engine itself tells: /version, /v1/models,
# vllm:cache_config_info in /metrics, and the probe's descriptor.
CONTRACT = {
    "engine_version": "0.32.0",
    "model": MODEL,
    "connector": "NixlConnector",
    "block_size": 128,
    "tp_size": 1,
}


async def test_a_contract_of_what_vllm_publishes_passes_with_proof_of_kv_use(
    real: RealStack,
) -> None:
    config = parse_config(
        {
            "model": MODEL,
            "engine": {"first_token_timeout_s": 60.0, "health_timeout_s": 30.0},
            "engine_contract": CONTRACT,
            "engines": [{"id": e.name, "url": e.url, "role": e.role} for e in real.fleet],
        }
    )
    rows = await run_preflight(config)
    report = format_report(rows)
    assert all(row.ok for row in rows), report
    transfer = next(row for row in rows if row.kind == "transfer")
    assert transfer.subject == "p0 -> d0"
    assert transfer.detail.startswith("KV transfer ok, "), report
    assert "prompt tokens pulled" in transfer.detail


async def test_a_contract_vllm_does_not_meet_names_the_field(real: RealStack) -> None:
    config = parse_config(
        {
            "model": MODEL,
            "engine": {"first_token_timeout_s": 60.0, "health_timeout_s": 30.0},
            "engine_contract": {**CONTRACT, "block_size": 16},
            "engines": [{"id": e.name, "url": e.url, "role": e.role} for e in real.fleet],
        }
    )
    rows = await run_preflight(config)
    details = {row.subject: row.detail for row in rows if not row.ok}
    assert details["p0"] == details["d0"] == "block_size: expected 16, got 128"

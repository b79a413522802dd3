"""Preflight: every engine meets the pinned contract, and real KV transfers work end to end.

`narwhal check` prints the table and exits 0 only when every row passes; `narwhal serve`
runs the same checks before it listens (unless `--skip-preflight`).
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from narwhal.config.engine_spec import EngineSpec
from narwhal.config.root import Config, ConfigError, load_config
from narwhal.config.secrets import Secrets, SecretsError, load_secrets
from narwhal.engines.client import EngineClient
from narwhal.engines.identity import (
    HANDOFF_FIELDS,
    IdentityError,
    contract_mismatches,
    handoff_mismatches,
    read_identity,
)
from narwhal.engines.probe import probe_transfer
from narwhal.engines.scrape import EXTERNAL, EngineReport, moved, read_report
from narwhal.protocol.errors import NarwhalError

# A consumer's pulled-token count is read up to this many times after a probe.
PROOF_READS = 10
PROOF_READ_GAP_S = 0.2


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the report: an engine's own checks, or one probed transfer."""

    kind: str  # "engine" or "transfer"
    subject: str
    ok: bool
    detail: str


def transfer_pairs(config: Config, mesh: bool) -> list[tuple[EngineSpec, EngineSpec]]:
    """Which (producer, consumer) handoffs to probe.

    By default a cover: every engine that may produce hands off to at least one engine
    that may consume, and every consumer receives from at least one producer. With
    `mesh`, every ordered pair of distinct engines. An engine pairs with itself only when
    no other engine can take the other role. KV moves only within one base model, so each
    model's engines are paired among themselves.
    """
    pools: dict[str, list[EngineSpec]] = {}
    for spec in config.engines:
        pools.setdefault(spec.model or config.model, []).append(spec)
    return [pair for specs in pools.values() for pair in _pairs(specs, mesh)]


def _pairs(specs: list[EngineSpec], mesh: bool) -> list[tuple[EngineSpec, EngineSpec]]:
    producers = [e for e in specs if e.role.can_prefill]
    consumers = [e for e in specs if e.role.can_decode]
    if not producers or not consumers:
        return []

    def partners(engine: EngineSpec, pool: list[EngineSpec]) -> list[EngineSpec]:
        return [p for p in pool if p.id != engine.id] or [p for p in pool if p.id == engine.id]

    if mesh:
        return [(p, c) for p in producers for c in partners(p, consumers)]
    pairs: list[tuple[EngineSpec, EngineSpec]] = []
    for index, producer in enumerate(producers):
        options = partners(producer, consumers)
        pairs.append((producer, options[index % len(options)]))
    covered = {c.id for _, c in pairs}
    for index, consumer in enumerate(c for c in consumers if c.id not in covered):
        options = partners(consumer, producers)
        pairs.append((options[index % len(options)], consumer))
    return pairs


async def check_engine(config: Config, session: aiohttp.ClientSession, spec: EngineSpec) -> Row:
    timeout = config.engine.health_timeout_s
    try:
        async with asyncio.timeout(timeout), session.get(spec.url + "/health") as response:
            if response.status != 200:
                return Row("engine", spec.id, False, f"/health answered HTTP {response.status}")
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Row("engine", spec.id, False, f"/health failed: {exc or 'timed out'}")
    contract = config.engine_contract
    if contract is None:
        return Row("engine", spec.id, True, "healthy (no contract pinned)")
    try:
        identity = await read_identity(session, spec, timeout)
    except IdentityError as exc:
        return Row("engine", spec.id, False, str(exc))
    mismatches = contract_mismatches(identity, contract)
    if mismatches:
        return Row("engine", spec.id, False, "; ".join(mismatches))
    deferred = sorted(HANDOFF_FIELDS & contract.pinned().keys())
    checked = [key for key in contract.pinned() if key not in deferred]
    detail = "healthy, meets the contract (pinned: " + ", ".join(checked)
    if deferred:
        detail += "; " + ", ".join(deferred) + " checked on its transfer"
    return Row("engine", spec.id, True, detail + ")")


async def check_transfer(
    config: Config, client: EngineClient, producer: EngineSpec, consumer: EngineSpec
) -> Row:
    """A probe handoff; a crossed one passes only if the consumer counted pulled tokens.

    Text coming back proves little: a consumer that cannot pull may recompute the prompt.
    Where the consumer counts prompt tokens by source (vLLM 0.32), its
    `external_kv_transfer` count must move across the probe.
    """
    subject = f"{producer.id} -> {consumer.id}"
    crossed = producer.id != consumer.id
    timeout = config.engine.health_timeout_s
    before = await read_report(client.session, consumer.url, timeout) if crossed else None
    try:
        transfer = await probe_transfer(
            client,
            producer.model or config.model,
            producer,
            consumer,
            config.engine.first_token_timeout_s,
        )
    except NarwhalError as error:
        return Row("transfer", subject, False, error.message)
    contract = config.engine_contract
    mismatches = handoff_mismatches(contract, transfer.descriptor) if contract else []
    if mismatches:
        return Row("transfer", subject, False, "; ".join(mismatches))
    decoded = f"decoded {transfer.text!r}"
    if not crossed:
        return Row("transfer", subject, True, f"same-worker ok, {decoded}")
    if before is None or not before.counts_sources:
        unproven = f"{consumer.id} publishes no vllm:prompt_tokens_by_source"
        return Row("transfer", subject, True, f"KV transfer ok (not proven: {unproven}), {decoded}")
    pulled = await _pulled(client.session, consumer, before, timeout)
    if not pulled:
        return Row(
            "transfer",
            subject,
            False,
            f"{consumer.id} decoded but pulled no KV: its vllm:prompt_tokens_by_source "
            '{source="external_kv_transfer"} did not move (it computed the prompt itself)',
        )
    return Row(
        "transfer", subject, True, f"KV transfer ok, {pulled:g} prompt tokens pulled, {decoded}"
    )


async def _pulled(
    session: aiohttp.ClientSession, spec: EngineSpec, before: EngineReport, timeout_s: float
) -> float:
    """Prompt tokens the engine pulled since `before`; read again for a moment, as an
    engine may count them a little after it answered."""
    pulled = 0.0
    for _ in range(PROOF_READS):
        after = await read_report(session, spec.url, timeout_s)
        pulled = moved(before, after, EXTERNAL) if after is not None else 0.0
        if pulled:
            break
        await asyncio.sleep(PROOF_READ_GAP_S)
    return pulled


async def run_preflight(
    config: Config, secrets: Secrets | None = None, *, mesh: bool = False
) -> list[Row]:
    """Engine checks first, then the transfers between engines that passed."""
    async with EngineClient(
        connect_timeout_s=config.engine.connect_timeout_s,
        prefill_timeout_s=config.engine.prefill_timeout_s,
        first_token_timeout_s=config.engine.first_token_timeout_s,
        decode_read_timeout_s=config.engine.decode_read_timeout_s,
        headers=(secrets or Secrets()).engine_headers(),
        ca_bundle=config.engine.ca_bundle,
    ) as client:
        engine_rows = await asyncio.gather(
            *(check_engine(config, client.session, spec) for spec in config.engines)
        )
        failed = {row.subject for row in engine_rows if not row.ok}
        rows = list(engine_rows)
        for producer, consumer in transfer_pairs(config, mesh):
            broken = sorted({producer.id, consumer.id} & failed)
            if broken:
                subject = f"{producer.id} -> {consumer.id}"
                rows.append(Row("transfer", subject, False, f"skipped: {', '.join(broken)} failed"))
            else:
                rows.append(await check_transfer(config, client, producer, consumer))
    return rows


def format_report(rows: list[Row]) -> str:
    width = max((len(row.subject) for row in rows), default=6)
    lines = [f"{'check':<9} {'subject':<{width}}  result  detail"]
    for row in rows:
        verdict = "ok" if row.ok else "FAILED"
        lines.append(f"{row.kind:<9} {row.subject:<{width}}  {verdict:<6}  {row.detail}")
    passed = sum(row.ok for row in rows)
    lines.append(f"{passed}/{len(rows)} checks passed")
    return "\n".join(lines)


async def check_command(path: Path, mesh: bool) -> int:
    try:
        config = load_config(path)
        secrets = load_secrets(config)
    except ConfigError as error:
        print(error.report(), file=sys.stderr)
        return 2
    except SecretsError as error:
        print(f"{path}: {error}", file=sys.stderr)
        return 2
    rows = await run_preflight(config, secrets, mesh=mesh)
    print(format_report(rows))
    return 0 if all(row.ok for row in rows) else 1

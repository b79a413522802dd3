"""What an engine says it is, read from what it serves, and the pinned contract it must meet.

vLLM exposes its version (`/version`), served models (`/v1/models`) and process start
time (`/metrics`); the KV connector and block size it does not, so an engine may name an
`identity_url` returning a JSON object of contract fields. A probe handoff's descriptor
adds `tp_size` and the engine's KV identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from narwhal.config import EngineContract, EngineSpec

_START_TIME = re.compile(rb"^process_start_time_seconds(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


@dataclass(slots=True)
class Identity:
    """Contract fields as read from one engine; absent fields were not exposed."""

    fields: dict[str, Any] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)
    process_start_time: float | None = None


class IdentityError(Exception):
    """The engine could not be asked (down, slow, or answering nonsense)."""


async def read_identity(
    session: aiohttp.ClientSession, spec: EngineSpec, timeout_s: float
) -> Identity:
    """Ask the engine what it is, all questions at once, within `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            version, models, metrics, extra = await asyncio.gather(
                _get_json(session, spec.url + "/version"),
                _get_json(session, spec.url + "/v1/models"),
                _get_bytes(session, spec.url + "/metrics"),
                _get_json(session, spec.identity_url) if spec.identity_url else _none(),
            )
    except TimeoutError:
        raise IdentityError(f"engine did not describe itself within {timeout_s:g} s") from None
    except (aiohttp.ClientError, ValueError) as exc:
        raise IdentityError(f"could not read the engine's identity: {exc}") from None
    identity = Identity()
    if isinstance(extra, dict):
        identity.fields.update(extra)
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        identity.fields["engine_version"] = version["version"]
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list):
        identity.models = [m["id"] for m in data if isinstance(m, dict) and "id" in m]
    match = _START_TIME.search(metrics)
    if match is not None:
        with contextlib.suppress(ValueError):
            identity.process_start_time = float(match.group(1))
    return identity


async def _none() -> None:
    return None


async def _get_bytes(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.get(url) as response:
        if response.status != 200:
            raise ValueError(f"GET {url} answered HTTP {response.status}")
        return await response.read()


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        return orjson.loads(await _get_bytes(session, url))
    except orjson.JSONDecodeError:
        raise ValueError(f"GET {url} did not answer JSON") from None


def contract_mismatches(
    identity: Identity, contract: EngineContract, descriptor: dict[str, Any] | None = None
) -> list[str]:
    """One message per pinned field the engine does not meet (empty when it meets all)."""
    seen = dict(identity.fields)
    if descriptor is not None and "tp_size" in descriptor:
        seen.setdefault("tp_size", descriptor["tp_size"])
    pinned: dict[str, Any] = {
        "engine_version": contract.engine_version,
        "connector": contract.connector,
        "block_size": contract.block_size,
        "tp_size": contract.tp_size,
        **contract.extra,
    }
    problems = []
    if contract.model not in identity.models and seen.get("model") != contract.model:
        served = ", ".join(identity.models) or "nothing"
        problems.append(f"model: expected {contract.model!r}, engine serves {served}")
    for key, expected in pinned.items():
        if key not in seen:
            problems.append(f"{key}: not exposed by the engine (give it an identity_url)")
        elif seen[key] != expected:
            problems.append(f"{key}: expected {expected!r}, got {seen[key]!r}")
    return problems

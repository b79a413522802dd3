"""What an engine says it is, read from what it serves, and the pinned contract it must meet.

vLLM exposes its version (`/version`), served models (`/v1/models`), and in `/metrics` its
process start time and its cache configuration (`vllm:cache_config_info`, whose labels
include `block_size`). The KV connector and the tensor-parallel size show in a handoff:
every descriptor carries `tp_size`, and a descriptor that passes the NIXL rules was issued
by a NixlConnector. These two are checked against the probe's descriptor, not the engine's
own answers. An engine may also name an `identity_url` returning a JSON object of contract
fields; what it says wins over what was read elsewhere.

What it serves is its `/v1/models` listing (`served_models`). vLLM 0.32 builds it in
`vllm/entrypoints/openai/models/serving.py` (`show_available_models`) from the cards of
`vllm/entrypoints/serve/engine/protocol.py` (`ModelCard`): one card per served model name
(`--served-model-name`, else `--model`) with `parent` null, `root` the model's path and
`max_model_len` set, then one card per LoRA adapter with `root` its path, `parent` its base
model's name and no `max_model_len`. `created` is the time of the listing, not of a load.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from narwhal.config.engine_spec import EngineContract, EngineSpec
from narwhal.engines.connector import NIXL_CONNECTOR

_START_TIME = re.compile(rb"^process_start_time_seconds(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)
_CACHE_INFO = re.compile(rb"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# Contract fields only a handoff shows; with no descriptor at hand they wait for the probe.
HANDOFF_FIELDS = frozenset({"tp_size", "connector"})


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One `/v1/models` entry, the members the router uses (vLLM's `permission` is not
    kept: a fresh id per listing, the same grants everywhere)."""

    id: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    owned_by: str | None = None


@dataclass(frozen=True, slots=True)
class ServedModels:
    """What an engine's `/v1/models` says it serves: its base model (the first card with no
    `parent`; None when it lists none), its other names for that model, its adapters in the
    order listed, and every card by id."""

    base: str | None
    names: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    cards: dict[str, ModelCard] = field(default_factory=dict)

    def serves(self, model: str) -> bool:
        """Whether `model` is one of its base model's names."""
        return model == self.base or model in self.names


def served_models(listing: Any) -> ServedModels:
    """The models an engine serves, from its `/v1/models` JSON (pure).

    Raises `ValueError` when it is not a listing (no `data` list). Entries without a
    string `id` are skipped; a member of the wrong type reads as absent. A card whose
    `parent` is set is an adapter, whichever base it names.
    """
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models answered no `data` list")
    cards: dict[str, ModelCard] = {}
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        card = ModelCard(
            entry["id"],
            _text(entry.get("root")),
            _text(entry.get("parent")),
            _whole(entry.get("max_model_len")),
            _text(entry.get("owned_by")),
        )
        cards.setdefault(card.id, card)
    bases = [card.id for card in cards.values() if card.parent is None]
    adapters = tuple(card.id for card in cards.values() if card.parent is not None)
    return ServedModels(bases[0] if bases else None, tuple(bases[1:]), adapters, cards)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_served(body: bytes) -> ServedModels | None:
    """`served_models` of a `/v1/models` body; None when it is not a listing."""
    try:
        return served_models(orjson.loads(body))
    except ValueError:  # orjson's decode error is one
        return None


async def read_served(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> ServedModels | None:
    """One reading of the engine's `/v1/models` at `url`; None when it cannot be read."""
    try:
        async with asyncio.timeout(timeout_s):
            return served_models(await _get_json(session, url + "/v1/models"))
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


@dataclass(slots=True)
class Identity:
    """Contract fields as read from one engine; absent fields were not exposed."""

    fields: dict[str, Any] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)
    # Its `/v1/models` as read (None: it answered no listing).
    served: ServedModels | None = None
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
    identity.fields.update(cache_config(metrics))
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        identity.fields["engine_version"] = version["version"]
    if isinstance(extra, dict):
        identity.fields.update(extra)
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list):
        identity.models = [m["id"] for m in data if isinstance(m, dict) and "id" in m]
        identity.served = served_models(models)
    match = _START_TIME.search(metrics)
    if match is not None:
        with contextlib.suppress(ValueError):
            identity.process_start_time = float(match.group(1))
    return identity


def cache_config(metrics: bytes) -> dict[str, Any]:
    """The labels of vLLM's `vllm:cache_config_info` series; whole numbers become ints."""
    match = _CACHE_INFO.search(metrics)
    if match is None:
        return {}
    fields: dict[str, Any] = {}
    for key, value in _LABEL.findall(match.group(1).decode("utf-8", "replace")):
        fields[key] = int(value) if value.isdigit() else value
    return fields


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
    """One message per pinned field the engine does not meet (empty when it meets all).

    Fields not pinned are not checked. Without a `descriptor`, the handoff fields
    (`HANDOFF_FIELDS`) the engine does not expose itself are left to `handoff_mismatches`.
    """
    seen = dict(identity.fields)
    if descriptor is not None:
        for key, value in _handoff_fields(descriptor).items():
            seen.setdefault(key, value)
    problems = []
    for key, expected in contract.pinned().items():
        if key == "model":
            if expected not in identity.models and seen.get("model") != expected:
                served = ", ".join(identity.models) or "nothing"
                problems.append(f"model: expected {expected!r}, engine serves {served}")
        elif key in seen:
            if seen[key] != expected:
                problems.append(f"{key}: expected {expected!r}, got {seen[key]!r}")
        elif descriptor is not None or key not in HANDOFF_FIELDS:
            problems.append(f"{key}: not exposed by the engine (give it an identity_url)")
    return problems


def handoff_mismatches(contract: EngineContract, descriptor: dict[str, Any] | None) -> list[str]:
    """The pinned handoff fields (`tp_size`, `connector`) against a probe's descriptor."""
    if descriptor is None:
        return []
    shown = _handoff_fields(descriptor)
    return [
        f"{key}: expected {expected!r}, descriptor says {shown.get(key)!r}"
        for key, expected in contract.pinned().items()
        if key in HANDOFF_FIELDS and shown.get(key) != expected
    ]


def _handoff_fields(descriptor: dict[str, Any]) -> dict[str, Any]:
    # Only descriptors that passed the NIXL rules reach here (the probe validates them).
    fields: dict[str, Any] = {"connector": NIXL_CONNECTOR}
    if "tp_size" in descriptor:
        fields["tp_size"] = descriptor["tp_size"]
    return fields

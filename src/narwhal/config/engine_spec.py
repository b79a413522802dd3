"""One engine as the configuration names it: its role, address, seat limits and contract.

An `[[engines]]` entry is read here by the same rules wherever it comes from (the fleet
file, the admin API, discovery), so an operator learns one set of rules.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from urllib.parse import urlsplit

from narwhal.config.models import model_name
from narwhal.config.table import Table, show

_ENGINE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HOST = re.compile(r"[^\s/@]+")


class Role(enum.StrEnum):
    """Which legs of a handoff an engine may serve."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def can_prefill(self) -> bool:
        """Whether the engine may be a producer (run the prefill leg)."""
        return self is not Role.DECODE

    @property
    def can_decode(self) -> bool:
        """Whether the engine may be a consumer (run the decode leg)."""
        return self is not Role.PREFILL

    def can_do(self, phase: str) -> bool:
        """Whether the role serves a phase named "prefill" or "decode"."""
        return self.can_prefill if phase == "prefill" else self.can_decode


ContractValue = str | int | float | bool


@dataclass(frozen=True, slots=True)
class EngineContract:
    """`[engine_contract]`: what every engine must be. Any subset may be pinned (a rolling
    upgrade may pin only `engine_version`); None is not pinned, and not checked. `extra`
    holds the free-form fields."""

    engine_version: str | None = None
    model: str | None = None
    connector: str | None = None
    block_size: int | None = None
    tp_size: int | None = None
    extra: Mapping[str, ContractValue] = field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )

    def pinned(self) -> dict[str, ContractValue]:
        """Every pinned field by name, the model included."""
        named = {
            "engine_version": self.engine_version,
            "model": self.model,
            "connector": self.connector,
            "block_size": self.block_size,
            "tp_size": self.tp_size,
        }
        return {
            **{key: value for key, value in named.items() if value is not None},
            **self.extra,
        }


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One `[[engines]]` entry: an engine's identity, address, role and seat limits."""

    id: str
    url: str
    role: Role
    max_prefill_seats: int = 64
    max_decode_seats: int = 256
    identity_url: str | None = None
    kv_hosts: tuple[str, ...] = ()
    # For role `both` (an engine run as kv_both): the phase it serves at start, "prefill"
    # or "decode"; None serves both. The role controller moves such engines.
    start_as: Role | None = None
    # The role controller never moves a pinned engine.
    pin: bool = False
    # The base model it serves; None: learnt from its `/v1/models` (else the default model).
    model: str | None = None

    @property
    def starting_role(self) -> Role:
        return self.start_as or self.role


def parse_contract(table: Table) -> EngineContract:
    contract = EngineContract(
        engine_version=table.optional_string("engine_version"),
        model=table.optional_string("model"),
        connector=table.optional_string("connector"),
        block_size=table.optional_integer("block_size", 1),
        tp_size=table.optional_integer("tp_size", 1),
    )
    extra: dict[str, ContractValue] = {}
    for key, value in table.rest().items():
        finite = not isinstance(value, float) or math.isfinite(value)
        if isinstance(value, str | int | float) and finite:
            extra[key] = value
        else:
            table.fail(key, f"must be a string, a finite number or a boolean, got {show(value)}")
    contract = replace(contract, extra=MappingProxyType(extra))
    if not contract.pinned() and not table.failed():
        table.fail_table("pins nothing: name at least one field, or leave the table out")
    return contract


def read_engine_spec(table: Table) -> EngineSpec:
    d = EngineSpec("", "", Role.BOTH)
    engine_id = table.string(
        "id",
        None,
        pattern=_ENGINE_ID,
        wanted='a string of 1 to 64 letters, digits, ".", "_" or "-"',
    )
    url = table.string("url", None)
    if url and (defect := _url_defect(url, path_ok=False)):
        table.fail("url", f"{defect}, got {show(url)}")
    elif url.endswith("/"):
        url = url[:-1]
    identity_url = table.optional_string("identity_url")
    if identity_url and (defect := _url_defect(identity_url, path_ok=True)):
        table.fail("identity_url", f"{defect}, got {show(identity_url)}")
    spec = EngineSpec(
        id=engine_id,
        url=url,
        role=table.choice("role", Role, None),
        max_prefill_seats=table.integer("max_prefill_seats", d.max_prefill_seats, 0),
        max_decode_seats=table.integer("max_decode_seats", d.max_decode_seats, 0),
        identity_url=identity_url,
        kv_hosts=table.strings("kv_hosts", pattern=_HOST),
        start_as=_start_as(table),
        pin=_pin(table),
        model=model_name(table, "model", required=False),
    )
    if spec.start_as is not None and spec.role is not Role.BOTH and not table.failed():
        table.fail(
            "start_as",
            f'needs role "both" (an engine that can serve either phase), got role '
            f"{show(spec.role.value)}",
        )
    table.close()
    return spec


def _start_as(table: Table) -> Role | None:
    if not table.has("start_as"):
        table.take("start_as", required=False)
        return None
    value = table.take("start_as", required=False)
    if value in (Role.PREFILL.value, Role.DECODE.value):
        return Role(value)
    table.fail("start_as", f'must be "prefill" or "decode", got {show(value)}')
    return None


def _pin(table: Table) -> bool:
    value = table.take("pin", required=False)
    if isinstance(value, bool):
        return value
    if table.has("pin"):
        table.fail("pin", f"must be true or false, got {show(value)}")
    return False


def _url_defect(url: str, *, path_ok: bool) -> str | None:
    """What is wrong with an engine URL, or None; the router appends the routes itself."""
    if any(char.isspace() for char in url):
        return "must not contain whitespace"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if not parts.hostname:
        return "must name a host"
    if parts.username is not None or parts.password is not None:
        return "must not carry credentials (name them with engine.api_key_env)"
    try:
        port = parts.port
    except ValueError:
        port = None
    if not port and ":" in parts.netloc.rsplit("]", 1)[-1]:
        return "must have a port in 1..65535"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "must not have a query or fragment"
    if not path_ok and parts.path not in ("", "/"):
        return 'must not have a path beyond "/" (the router adds the routes)'
    return None


def url_address(url: str) -> tuple[str, str, int]:
    """An engine URL reduced to what decides where it connects, for spotting duplicates."""
    parts = urlsplit(url)
    default_port = 443 if parts.scheme == "https" else 80
    return parts.scheme, parts.hostname or "", parts.port or default_port

"""One engine outside a fleet file: the admin API's bodies, checked as `[[engines]]` entries.

`POST /narwhal/engines` takes one `[[engines]]` entry and `PATCH /narwhal/engines/{id}`
the keys an engine may change in place. Both are checked by the same rules as a fleet file
and refused whole, every problem named by key path and value as `narwhal config validate`
names them, so an operator learns one set of rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from narwhal.config.engine_spec import EngineSpec, Role, read_engine_spec, url_address
from narwhal.config.root import ConfigError, ServerConfig, is_router_address
from narwhal.config.table import Problems, Table, show

# What a PATCH may change; anything else (the id, the url) means another engine.
PATCHABLE = ("role", "max_prefill_seats", "max_decode_seats", "pin")
_FIXED = ("id", "url", "identity_url", "kv_hosts")


@dataclass(frozen=True, slots=True)
class EnginePatch:
    """The keys a PATCH named; None for those it left alone."""

    role: Role | None = None
    max_prefill_seats: int | None = None
    max_decode_seats: int | None = None
    pin: bool | None = None

    def apply(self, spec: EngineSpec) -> EngineSpec:
        """The spec with this patch's role and seat limits (the pin is not part of a spec)."""
        return EngineSpec(
            id=spec.id,
            url=spec.url,
            role=spec.role if self.role is None else self.role,
            max_prefill_seats=(
                spec.max_prefill_seats if self.max_prefill_seats is None else self.max_prefill_seats
            ),
            max_decode_seats=(
                spec.max_decode_seats if self.max_decode_seats is None else self.max_decode_seats
            ),
            identity_url=spec.identity_url,
            kv_hosts=spec.kv_hosts,
            # A new role ends the starting phase a role `both` engine was given.
            start_as=spec.start_as if self.role in (None, spec.role) else None,
            pin=spec.pin,
        )


def parse_engine_entry(raw: object, server: ServerConfig, source: str = "body") -> EngineSpec:
    """An `[[engines]]` entry as a fleet file would give it; ConfigError lists every problem.

    Whether its id or url is already in use is the fleet's question, not this one's.
    """
    problems = Problems()
    if not isinstance(raw, Mapping):
        raise ConfigError([f"must be an object of [[engines]] keys, got {show(raw)}"], source)
    table = Table(problems, "", raw)
    spec = read_engine_spec(table)
    if not problems.failed("url") and is_router_address(url_address(spec.url), server):
        problems.add(
            "url",
            f"points at the router itself (server.host {show(server.host)}, "
            f"server.port {server.port}), got {show(spec.url)}",
        )
    if problems.messages:
        raise ConfigError(problems.messages, source)
    return spec


def parse_engine_patch(raw: object, source: str = "body") -> EnginePatch:
    """The keys of `PATCHABLE` an operator named; ConfigError lists every problem."""
    if not isinstance(raw, Mapping):
        raise ConfigError([f"must be an object with some of {', '.join(PATCHABLE)}"], source)
    if not any(key in raw for key in (*PATCHABLE, *_FIXED)):
        raise ConfigError([f"names nothing to change: give some of {', '.join(PATCHABLE)}"], source)
    problems = Problems()
    table = Table(problems, "", raw)
    for key in _FIXED:
        if table.has(key):
            table.take(key, required=False)
            table.fail(key, "cannot change in place: delete the engine and add it anew")
    role = table.choice("role", Role, None) if table.has("role") else None
    prefill = table.optional_integer("max_prefill_seats", 0)
    decode = table.optional_integer("max_decode_seats", 0)
    pin = table.take("pin", required=False)
    if table.has("pin") and not isinstance(pin, bool):
        table.fail("pin", f"must be true or false, got {show(pin)}")
    table.close()
    if problems.messages:
        raise ConfigError(problems.messages, source)
    return EnginePatch(
        role=role,
        max_prefill_seats=prefill,
        max_decode_seats=decode,
        pin=pin if isinstance(pin, bool) else None,
    )


def same_engine_url(a: str, b: str) -> bool:
    """Whether two engine urls name one engine (scheme, host and port, default ports too)."""
    return url_address(a) == url_address(b)


def problem_path(error: ConfigError) -> str | None:
    """The key path of the first problem (`url`, `kv_hosts[0]`), or None for the whole body."""
    head, sep, _ = error.problems[0].partition(": ")
    return head if sep and head and " " not in head else None

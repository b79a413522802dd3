"""`[[tenants]]` and `[tenants_policy]`: who shares the fleet, with which rights and limits.

A tenant is a set of client keys with a weight and a priority band for the scheduler, and
optional limits: requests at once, requests and tokens per minute, and a time-to-first-token
objective past which a request is refused rather than queued. Keys listed under tenants are
client keys: they turn client authentication on, as `server.api_keys` do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final

from narwhal.config.table import MISSING, Problems, Table, env_name, is_int, show

# Tenant names appear in metrics labels, the journal and URLs of the admin API.
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One `[[tenants]]` entry; every limit is optional (None: no such limit)."""

    name: str
    # Kept out of repr so that logging a config never logs a credential.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_env: str | None = None
    weight: float = 1.0
    # The band: a lower number is served first (as vLLM's `priority`).
    priority: int = 0
    max_concurrent: int | None = None
    # None: the router's whole queue (`serving.queue_capacity`).
    max_queued: int | None = None
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    ttft_objective_s: float | None = None

    @property
    def limited(self) -> bool:
        """Whether any admission limit applies (a tenant without one costs nothing to admit)."""
        return (
            self.max_concurrent is not None
            or self.requests_per_minute is not None
            or self.tokens_per_minute is not None
        )


@dataclass(frozen=True, slots=True)
class TenantsPolicy:
    """`[tenants_policy]`: the default tenant, and whether bands reach the engines."""

    # The tenant of requests whose key names none (every request when authentication is
    # off); None: such requests have no tenant, and no tenant's limits.
    default: str | None = None
    # Send each request's band as vLLM's `priority` on both legs (it orders an engine's
    # queue only when the engine runs with `--scheduling-policy priority`).
    engine_priority: bool = False
    # A busy pool's last free decode seats, kept for requests of a more important band
    # or of a tenant holding less than its share (`fleet.reserve`); 0: none kept.
    reserved_seats: int = 0


# The limits an admin API body may change at runtime, with how each is read.
LIMIT_KEYS: Final = (
    "weight",
    "priority",
    "max_concurrent",
    "max_queued",
    "requests_per_minute",
    "tokens_per_minute",
    "ttft_objective_s",
)


def parse_tenant(table: Table) -> TenantConfig:
    """One `[[tenants]]` table."""
    name = table.string(
        "name", None, pattern=_NAME, wanted="a name of letters, digits and _ . : - (at most 64)"
    )
    tenant = read_limits(
        table,
        TenantConfig(
            name=name,
            api_keys=table.strings("api_keys", secret=True),
            api_keys_env=env_name(table, "api_keys_env"),
        ),
    )
    table.close()
    return tenant


def read_limits(table: Table, base: TenantConfig) -> TenantConfig:
    """`base` with the scheduling keys and limits `table` sets; absent keys keep `base`'s.
    Shared by the file and the admin API's runtime changes (where `null` lifts a limit)."""
    return replace(
        base,
        weight=table.number("weight", base.weight),
        priority=_band(table, base.priority),
        max_concurrent=_optional_count(table, "max_concurrent", base.max_concurrent),
        max_queued=_optional_count(table, "max_queued", base.max_queued),
        requests_per_minute=_optional_number(
            table, "requests_per_minute", base.requests_per_minute
        ),
        tokens_per_minute=_optional_number(table, "tokens_per_minute", base.tokens_per_minute),
        ttft_objective_s=_optional_number(table, "ttft_objective_s", base.ttft_objective_s),
    )


def tenant_patch(base: TenantConfig, raw: object) -> tuple[TenantConfig, list[str]]:
    """`base` changed by an admin API body of `LIMIT_KEYS` (`null` lifts a limit); the
    problems found, each naming its key, when the body is not such an object."""
    problems = Problems()
    if not isinstance(raw, Mapping) or not raw:
        return base, [f"must be an object with some of {', '.join(LIMIT_KEYS)}"]
    table = Table(problems, "", raw)
    changed = read_limits(table, base)
    table.close()
    return changed, problems.messages


def parse_tenants_policy(table: Table) -> TenantsPolicy:
    policy = TenantsPolicy(
        default=table.optional_string("default"),
        engine_priority=table.boolean("engine_priority", False),
        reserved_seats=table.integer("reserved_seats", 0, 0),
    )
    table.close()
    return policy


def check_tenants(
    tenants: Iterable[TenantConfig], policy: TenantsPolicy, problems: Problems
) -> None:
    """Names unique, keys each in one tenant, the default tenant one of them."""
    seen: dict[str, int] = {}
    owner: dict[str, str] = {}
    named = True
    for index, tenant in enumerate(tenants):
        if problems.failed(f"tenants[{index}].name"):
            named = False
            continue
        if tenant.name in seen:
            problems.add(
                f"tenants[{index}].name",
                f"{show(tenant.name)} is already the name of tenants[{seen[tenant.name]}]",
            )
        seen.setdefault(tenant.name, index)
        for key_index, key in enumerate(tenant.api_keys):
            if key in owner and owner[key] != tenant.name:
                problems.add(
                    f"tenants[{index}].api_keys[{key_index}]",
                    f"is already a key of tenant {show(owner[key])} (value withheld)",
                )
            owner.setdefault(key, tenant.name)
    if (
        policy.default is not None
        and policy.default not in seen
        and named
        and not problems.failed("tenants_policy.default")
    ):
        known = ", ".join(sorted(seen)) or "none"
        problems.add(
            "tenants_policy.default",
            f"must name a tenant in [[tenants]] ({known}), got {show(policy.default)}",
        )


def _band(table: Table, default: int) -> int:
    """Any integer: vLLM's priority takes negative ones too."""
    value = table.take("priority", required=False)
    if value is MISSING:
        return default
    if is_int(value):
        return value
    table.fail("priority", f"must be an integer (lower is served first), got {show(value)}")
    return default


def _optional_count(table: Table, key: str, default: int | None) -> int | None:
    if not table.has(key):
        table.take(key, required=False)
        return default
    if table.take(key, required=False) is None:
        return None
    return table.integer(key, 1, 1)


def _optional_number(table: Table, key: str, default: float | None) -> float | None:
    if not table.has(key):
        table.take(key, required=False)
        return default
    if table.take(key, required=False) is None:
        return None
    return table.number(key, 1.0)

"""Credentials, read once at start-up from the environment variables the config names.

They are read through `config.environment`, the one module that reads the environment. Keys
are compared in constant time and never logged, journaled or forwarded: client keys stay at
the router, and engines get only the engine key.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from narwhal.config.environment import process_environment
from narwhal.config.root import Config


class SecretsError(ValueError):
    """A configured credential variable is missing or empty."""


@dataclass(frozen=True, slots=True)
class Secrets:
    client_keys: tuple[bytes, ...] = field(default=(), repr=False)
    admin_keys: tuple[bytes, ...] = field(default=(), repr=False)
    engine_key: str | None = field(default=None, repr=False)
    # Each tenant's keys (they are client keys too), to name a request's tenant.
    tenant_keys: dict[bytes, str] = field(default_factory=dict, repr=False)

    def tenant_of(self, header: str | None) -> str | None:
        """The tenant whose key `Authorization: Bearer <key>` carries, or None. Called only
        for a request whose key was accepted, so the lookup reveals nothing new."""
        if not self.tenant_keys or header is None or not header.startswith("Bearer "):
            return None
        return self.tenant_keys.get(header[7:].strip().encode())

    def engine_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.engine_key}"} if self.engine_key else {}


def load_secrets(config: Config, environ: Mapping[str, str] | None = None) -> Secrets:
    """The credentials `config` names, from `environ` (by default this process's environment)."""
    if environ is None:
        environ = process_environment()
    client = list(config.server.api_keys) + _keys(
        environ, "api_keys_env", config.server.api_keys_env
    )
    admin = list(config.server.admin_api_keys) + _keys(
        environ, "admin_api_keys_env", config.server.admin_api_keys_env
    )
    tenant_keys: dict[bytes, str] = {}
    for index, tenant in enumerate(config.tenants):
        keys = list(tenant.api_keys) + _keys(
            environ, f"tenants[{index}].api_keys_env", tenant.api_keys_env, prefix=""
        )
        for key in keys:
            tenant_keys.setdefault(key.encode(), tenant.name)
    client += [key.decode() for key in tenant_keys]
    engine_key = None
    engine_env = config.engine.api_key_env
    if engine_env is not None:
        engine_key = environ.get(engine_env, "").strip()
        if not engine_key:
            raise SecretsError(f"engine.api_key_env names {engine_env}, which is unset or empty")
    return Secrets(
        client_keys=tuple(key.encode() for key in client),
        admin_keys=tuple(key.encode() for key in admin),
        engine_key=engine_key,
        tenant_keys=tenant_keys,
    )


def _keys(
    environ: Mapping[str, str], key: str, variable: str | None, prefix: str = "server."
) -> list[str]:
    """The comma-separated keys in the variable `<prefix><key>` names (none if it names none)."""
    if variable is None:
        return []
    keys = [part.strip() for part in environ.get(variable, "").split(",") if part.strip()]
    if not keys:
        raise SecretsError(f"{prefix}{key} names {variable}, which is unset or empty")
    return keys


def bearer_allowed(header: str | None, keys: tuple[bytes, ...]) -> bool:
    """Whether `Authorization: Bearer <key>` names one of `keys`, compared in constant time.

    Every key is compared, so the time taken does not reveal which one nearly matched.
    """
    if header is None or not header.startswith("Bearer "):
        return False
    offered = header[7:].strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(offered, key)
    return matched

"""A router with `[[tenants]]`, as the observers (metrics, `/narwhal/state`) see it."""

from __future__ import annotations

from typing import Any

from narwhal.app.process import Router
from narwhal.config.root import parse_config
from narwhal.router.admission import Admission

ENGINES = [
    {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode"},
]


def tenant_router(tenants: list[dict[str, Any]], default: str | None = None) -> Router:
    """A router (no engine reachable) with `tenants` and `default` as its default tenant;
    its admission is `router.admission` (None without tenants), limits kept in this
    process."""
    policy = {} if default is None else {"default": default}
    config = parse_config(
        {"model": "m", "engines": ENGINES, "tenants": tenants, "tenants_policy": policy},
        source="test",
    )
    return Router(config)


def admission(router: Router) -> Admission:
    """The router's admission (a router with tenants has one)."""
    assert router.admission is not None
    return router.admission

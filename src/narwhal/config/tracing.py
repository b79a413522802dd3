"""`[tracing]`: whether the router exports OpenTelemetry spans, and where to.

The file's table is read with the rest of the configuration (so `narwhal config validate`
names a bad key by its path); the standard `OTEL_*` environment variables are applied at
start-up by `resolve_tracing`, which takes the environment as an argument so it stays pure.
A key set in the file wins over its variable; the variable fills in what the file leaves out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from narwhal.config.table import Table

DEFAULT_SERVICE_NAME = "narwhal"
# Appended to an `endpoint` given without a path, as the OTLP exporters do for a base URL.
TRACES_PATH = "/v1/traces"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """`[tracing]` as written; None means the key was left out."""

    # None: on when the environment names an OTLP endpoint, off otherwise.
    enabled: bool | None = None
    endpoint: str | None = None
    service_name: str | None = None
    # None: the OTEL_TRACES_SAMPLER variables decide (by default, every trace is kept).
    sample_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Tracing as it will run: present only when it is on."""

    # None: the exporter reads OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT itself.
    endpoint: str | None
    # None: OTEL_SERVICE_NAME names the service (the resource reads it).
    service_name: str | None
    sample_ratio: float | None


def parse_tracing(table: Table) -> TracingConfig:
    """Read `[tracing]`, recording each bad key's problem under its path."""
    # Every key is asked for, present or not, so that a misspelt one gets a suggestion.
    enabled: bool | None = None
    raw = table.take("enabled", required=False)
    if isinstance(raw, bool):
        enabled = raw
    elif table.has("enabled"):
        table.fail("enabled", f"must be true or false, got {_shown(raw)}")
    endpoint = table.optional_string("endpoint")
    if endpoint is not None:
        if _is_http_url(endpoint):
            endpoint = traces_url(endpoint)
        else:
            table.fail("endpoint", f"must be an http:// or https:// URL, got {_shown(endpoint)}")
            endpoint = None
    service_name = table.optional_string("service_name")
    ratio = table.fraction("sample_ratio", 1.0)
    sample_ratio = ratio if table.has("sample_ratio") else None
    table.close()
    return TracingConfig(enabled, endpoint, service_name, sample_ratio)


def resolve_tracing(config: TracingConfig, environ: Mapping[str, str]) -> TracingSettings | None:
    """Tracing as the file and the environment decide it together; None when it is off.

    OTEL_SDK_DISABLED=true (and OTEL_TRACES_EXPORTER=none) turn it off whatever the file
    says: they are the operator's switch for the process.
    """
    if _flag(environ, "OTEL_SDK_DISABLED") == "true":
        return None
    if _flag(environ, "OTEL_TRACES_EXPORTER") == "none":
        return None
    enabled = config.enabled
    if enabled is None:
        enabled = bool(
            environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
            or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        )
    if not enabled:
        return None
    service_name = config.service_name
    if service_name is None and not environ.get("OTEL_SERVICE_NAME", "").strip():
        service_name = DEFAULT_SERVICE_NAME
    return TracingSettings(config.endpoint, service_name, config.sample_ratio)


def traces_url(endpoint: str) -> str:
    """The traces URL for `endpoint`: as given when it has a path, else the OTLP default."""
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


def _is_http_url(endpoint: str) -> bool:
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _shown(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _flag(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip().lower()

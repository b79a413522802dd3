"""`[discovery]`: engines found as pods through the Kubernetes API, beside or instead of
`[[engines]]`.

Read with the rest of the configuration, so `narwhal config validate` names a bad key by its
path. The pure reading of a pod is `narwhal.fleet.sources.pods`, the watcher
`narwhal.fleet.sources.kubernetes`, and what the router does with both `narwhal.fleet.discovery`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from narwhal.config.table import Table, show

# A Kubernetes name (namespace, container port name): a DNS label.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# A label or annotation key: an optional DNS-subdomain prefix and a name.
_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


class Credentials(enum.StrEnum):
    """Where the Kubernetes client finds its API server and credentials."""

    # The pod's service account when running in a cluster, else the kubeconfig.
    AUTO = "auto"
    IN_CLUSTER = "in_cluster"
    KUBECONFIG = "kubeconfig"


class Scheme(enum.StrEnum):
    HTTP = "http"
    HTTPS = "https"


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """`[discovery]` with its defaults (docs/deployment.md, "Kubernetes discovery")."""

    enabled: bool = False
    # The only source so far; named so that a file says what it relies on.
    kind: str = "kubernetes"
    namespace: str = "default"
    # Which pods are engines, e.g. "app=vllm,model=llama"; required when enabled.
    label_selector: str = ""
    # Read from the pod's annotations first, then its labels.
    role_key: str = "narwhal/role"
    # The role of a pod that names none; None: such a pod is not an engine.
    default_role: str | None = None
    prefill_seats_key: str = "narwhal/max-prefill-seats"
    decode_seats_key: str = "narwhal/max-decode-seats"
    # The engine's port: the annotation `port_key`, else the container port named
    # `port_name`, else `port`.
    port_key: str = "narwhal/port"
    # The base model the pod serves (annotation, else label); absent: read from its
    # `/v1/models`.
    model_key: str = "narwhal/model"
    port_name: str | None = None
    port: int = 8000
    scheme: Scheme = Scheme.HTTP
    credentials: Credentials = Credentials.AUTO
    # A kubeconfig file and context; None: the client's default file and current context.
    kubeconfig: str | None = None
    context: str | None = None
    # A watch is re-opened (from the last resourceVersion, no relist) after this long.
    watch_timeout_s: int = 300
    # After a failure, the next try waits this long, doubling up to `max_backoff_s`.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0


_ROLES = ("prefill", "decode", "both")


def parse_discovery(table: Table) -> DiscoveryConfig:
    """Read `[discovery]`, recording each bad key's problem under its path."""
    d = DiscoveryConfig()
    enabled = table.boolean("enabled", d.enabled)
    kind = table.string("kind", d.kind)
    if kind != "kubernetes":
        table.fail("kind", f'must be "kubernetes", got {show(kind)}')
    namespace = table.string(
        "namespace", d.namespace, pattern=_DNS_LABEL, wanted="a Kubernetes namespace name"
    )
    selector = table.optional_string("label_selector")
    if enabled and not table.failed() and not selector:
        table.fail(
            "label_selector",
            'is required when discovery is enabled (which pods are engines, e.g. "app=vllm")',
        )
    default_role = table.optional_string("default_role")
    if default_role is not None and default_role not in _ROLES:
        table.fail(
            "default_role", f'must be "prefill", "decode" or "both", got {show(default_role)}'
        )
        default_role = None
    config = DiscoveryConfig(
        enabled=enabled,
        kind=kind,
        namespace=namespace,
        label_selector=selector or "",
        role_key=_key(table, "role_key", d.role_key),
        default_role=default_role,
        prefill_seats_key=_key(table, "prefill_seats_key", d.prefill_seats_key),
        decode_seats_key=_key(table, "decode_seats_key", d.decode_seats_key),
        port_key=_key(table, "port_key", d.port_key),
        model_key=_key(table, "model_key", d.model_key),
        port_name=table.string("port_name", "", pattern=_DNS_LABEL, wanted="a port name") or None,
        port=table.integer("port", d.port, 1, 65535),
        scheme=table.choice("scheme", Scheme, d.scheme),
        credentials=table.choice("credentials", Credentials, d.credentials),
        kubeconfig=table.optional_string("kubeconfig"),
        context=table.optional_string("context"),
        watch_timeout_s=table.integer("watch_timeout_s", d.watch_timeout_s, 1, 3600),
        backoff_s=table.number("backoff_s", d.backoff_s),
        max_backoff_s=table.number("max_backoff_s", d.max_backoff_s),
    )
    if config.max_backoff_s < config.backoff_s and not table.failed():
        table.fail(
            "max_backoff_s",
            f"must be at least backoff_s ({config.backoff_s:g}), got {config.max_backoff_s:g}",
        )
    table.close()
    return config


def _key(table: Table, key: str, default: str) -> str:
    return table.string(key, default, pattern=_KEY, wanted="a label or annotation key")


def discovery_summary(config: DiscoveryConfig) -> str:
    """One line for `narwhal config validate` and `narwhal serve`."""
    role = f", else {config.default_role}" if config.default_role else ""
    port = f"container port {config.port_name}" if config.port_name else str(config.port)
    return (
        f"{config.kind} pods in {config.namespace} matching {config.label_selector!r} "
        f"({config.credentials.value} credentials); role from {config.role_key}{role}, port "
        f"from {config.port_key} else {port}"
    )

"""Narwhal's configuration: one frozen, typed object, built and validated once at start-up.

Every problem in a fleet file is collected and reported together, each naming its key path and
the bad value, so an operator fixes the file in one pass instead of one restart per mistake.
Nothing here reads the environment: `engine.api_key_env` is only the *name* of a variable.
"""

from __future__ import annotations

import enum
import json
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from narwhal.config.continuation import ContinuationConfig, parse_continuation
from narwhal.config.controller import (
    ControllerConfig,
    SloConfig,
    parse_controller,
    parse_slo,
)
from narwhal.config.discovery import DiscoveryConfig, parse_discovery
from narwhal.config.engine_spec import (
    EngineContract,
    EngineSpec,
    parse_contract,
    read_engine_spec,
    url_address,
)
from narwhal.config.models import (
    LoraConfig,
    ModelConfig,
    check_names,
    model_name,
    parse_lora,
    parse_model,
)
from narwhal.config.placement import PlacementConfig, parse_placement
from narwhal.config.responses import ResponsesConfig, parse_responses
from narwhal.config.table import Problems, Table, env_name, show
from narwhal.config.tenants import (
    TenantConfig,
    TenantsPolicy,
    check_tenants,
    parse_tenant,
    parse_tenants_policy,
)
from narwhal.config.tracing import TracingConfig, parse_tracing
from narwhal.config.workers import Workers, parse_replicas, parse_workers


class RestartPolicy(enum.StrEnum):
    """How ejected engines return: each on its own, or a restart wave all together."""

    INDIVIDUAL = "individual"
    WHOLE_WAVE = "whole_wave"


class NonstreamDecode(enum.StrEnum):
    """How a non-streaming client request's decode leg is sent: streamed and assembled by
    the router, or asked for whole and the consumer's answer forwarded as it came."""

    STREAM = "stream"
    WHOLE = "whole"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """`[server]`: where the router listens and who may call it."""

    host: str = "127.0.0.1"
    port: int = 8000
    graceful_timeout_s: float = 30.0
    # A client must send a request's headers, and then its body, within this; idle
    # keep-alive connections are closed after it too.
    client_timeout_s: float = 30.0
    # Kept out of repr so that logging a config never logs a credential.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Names an environment variable holding more client keys, comma-separated.
    api_keys_env: str | None = None
    # The same for admin keys (a Kubernetes Secret mounted as a variable).
    admin_api_keys_env: str | None = None
    # Router processes on this port (`workers_config`); "auto": one per usable core.
    workers: Workers = 1
    # Router replicas sharing the fleet: each takes 1/replicas of every seat limit.
    replicas: int = 1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """`[engine]`: how the router talks to every engine."""

    first_token_timeout_s: float = 2.5
    decode_read_timeout_s: float = 10.0
    prefill_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    health_timeout_s: float = 5.0
    # How often each engine's own /metrics is read (its load, proof of KV use); 0: never.
    metrics_interval_s: float = 1.0
    # vLLM 0.32's NixlConnector holds unpulled blocks for a 30 s lease
    # (`kv_connector_extra_config.kv_lease_duration`); older versions for 480 s.
    kv_lease_s: float = 30.0
    # Free an abandoned handoff's blocks at once through a consumer (see `engines.release`)
    # rather than leave them pinned for the rest of the lease.
    release_abandoned: bool = True
    api_key_env: str | None = None
    ca_bundle: str | None = None
    # A non-streaming request's decode leg: streamed (the first-token rules) or whole.
    nonstream_decode: NonstreamDecode = NonstreamDecode.STREAM
    # The longest wait for a whole answer, from sending the decode; 0: the request
    # deadline alone bounds it.
    whole_answer_timeout_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """`[serving]`: per-request deadline, retries and admission."""

    request_timeout_s: float = 600.0
    max_attempts: int = 1
    retry_budget: int = 10
    retry_replenish: float = 0.1
    max_request_bytes: int = 4_194_304
    queue_capacity: int = 1024
    queue_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    """`[recovery]`: ejection, readmission and quarantine of failing engines."""

    eject_after: int = 3
    # At most this share of a phase's engines may be ejected at once (one may always go
    # while others remain), so the breaker never empties a phase on its own.
    max_ejected_fraction: float = 0.5
    readmit_interval_s: float = 10.0
    # How often an ejected engine is judged while a phase it serves has no admitted engine.
    urgent_readmit_interval_s: float = 1.0
    failure_quarantine_s: float = 0.0
    restart_policy: RestartPolicy = RestartPolicy.INDIVIDUAL


@dataclass(frozen=True, slots=True)
class JournalConfig:
    """`[journal]`: where one JSON line per request goes; no journal when `path` is None."""

    path: str | None = None


# The safety margin kept between the handoff bound and the producer's KV lease.
_HANDOFF_MARGIN: Final = 1 / 6


@dataclass(frozen=True, slots=True)
class Config:
    """The whole validated configuration; build it with `load_config` or `parse_config`."""

    # The default model: what a request without `model` gets, and a one-model fleet's only.
    model: str
    engines: tuple[EngineSpec, ...]
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    engine_contract: EngineContract | None = None
    tracing: TracingConfig = field(default_factory=TracingConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    continuation: ContinuationConfig = field(default_factory=ContinuationConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    models: tuple[ModelConfig, ...] = ()
    lora: LoraConfig = field(default_factory=LoraConfig)
    tenants: tuple[TenantConfig, ...] = ()
    tenants_policy: TenantsPolicy = field(default_factory=TenantsPolicy)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    # Key paths left unset whose default was clamped to fit another key (see `_BOUNDED`).
    derived: tuple[str, ...] = ()

    @property
    def handoff_bound_s(self) -> float:
        """The oldest a handoff may be when its decode is sent: the KV lease less a sixth."""
        return self.engine.kv_lease_s * (1 - _HANDOFF_MARGIN)

    def engine_spec(self, engine_id: str) -> EngineSpec:
        """The engine with this id; KeyError if there is none."""
        for spec in self.engines:
            if spec.id == engine_id:
                return spec
        raise KeyError(engine_id)


class ConfigError(Exception):
    """Every problem found in one configuration; `str()` gives one problem per line."""

    def __init__(self, problems: Iterable[str], source: str) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        self.source = source
        super().__init__("\n".join(self.problems))

    def report(self) -> str:
        """The report printed at start-up and by `narwhal config validate`."""
        count = len(self.problems)
        header = f"{self.source}: {count} problem{'' if count == 1 else 's'}"
        return "\n".join([header, *(f"  {problem}" for problem in self.problems)])


def load_config(path: Path) -> Config:
    """Read a fleet file (`.toml`, or `.json` with the same structure) and validate it."""
    source = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError([f'unsupported file type "{path.suffix}": use .toml or .json'], source)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(["file not found"], source) from None
    except OSError as error:
        raise ConfigError([f"cannot read file: {error.strerror or error}"], source) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError([f"not valid UTF-8 at byte {error.start}"], source) from None
    if suffix == ".toml":
        try:
            raw: object = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError([f"invalid TOML: {error}"], source) from None
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            where = f"(at line {error.lineno}, column {error.colno})"
            raise ConfigError([f"invalid JSON: {error.msg} {where}"], source) from None
    return _build(raw, source)


def parse_config(data: Mapping[str, object], source: str = "<config>") -> Config:
    """Validate an already-parsed mapping, as `load_config` does for a file."""
    return _build(data, source)


# --- Reading -------------------------------------------------------------------------------

_LOOPBACK: Final = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD: Final = frozenset({"0.0.0.0", "::", ""})


# --- Building ------------------------------------------------------------------------------


def _build(raw: object, source: str) -> Config:
    problems = Problems()
    if not isinstance(raw, Mapping):
        raise ConfigError([f"the top level must be a table of keys, got {show(raw)}"], source)
    top = Table(problems, "", raw)
    named_model = model_name(top, "model", required=not _names_models(raw))
    server = _server(top.table("server"))
    engine = _engine(top.table("engine"))
    serving = _serving(top.table("serving"))
    recovery = _recovery(top.table("recovery"))
    journal = _journal(top.table("journal"))
    tracing = parse_tracing(top.table("tracing"))
    controller = parse_controller(top.table("controller"))
    slo = parse_slo(top.table("slo"))
    continuation = parse_continuation(top.table("continuation"))
    contract_table = top.optional_table("engine_contract")
    contract = parse_contract(contract_table) if contract_table else None
    discovery = parse_discovery(top.table("discovery"))
    placement = parse_placement(top.table("placement"))
    models = tuple(
        parse_model(Table(problems, f"models[{index}]", entry), slo)
        for index, entry in enumerate(top.items("models", required=False) or ())
    )
    lora = parse_lora(top.table("lora"))
    tenants = tuple(
        parse_tenant(Table(problems, f"tenants[{index}]", entry))
        for index, entry in enumerate(top.items("tenants", required=False) or ())
    )
    tenants_policy = parse_tenants_policy(top.table("tenants_policy"))
    responses = parse_responses(top.table("responses"))
    # With discovery on, `[[engines]]` may be absent: the pods are the fleet.
    entries = top.items("engines", required=not discovery.enabled)
    engines: dict[str, EngineSpec] = {}
    for index, entry in enumerate(entries or ()):
        table = Table(problems, f"engines[{index}]", entry)
        if isinstance(entry, Mapping):
            engines[table.where] = read_engine_spec(table)
    top.close()
    engine_models = {path: spec.model for path, spec in engines.items() if spec.model}
    model = _default_model(named_model, models, engine_models.values(), problems)
    check_names(named_model, models, lora, engine_models, problems)
    config = Config(
        model,
        tuple(engines.values()),
        server,
        engine,
        serving,
        recovery,
        journal,
        contract,
        tracing,
        controller,
        slo,
        continuation,
        discovery,
        placement,
        models,
        lora,
        tenants,
        tenants_policy,
        responses,
    )
    config = _derive_defaults(config, raw)
    check_tenants(tenants, tenants_policy, problems)
    _check_model_timeouts(config, problems)
    _check_timeouts(config, problems)
    if entries is not None:
        complete = len(engines) == len(entries)
        _check_engines(engines, complete, config.server, problems, discovery.enabled)
        ids = {spec.id for spec in engines.values()}
        for name in placement.kv_events:
            if complete and not discovery.enabled and name not in ids:
                problems.add(f"placement.kv_events.{name}", "names no engine in [[engines]]")
    served = {model, *(m.name for m in models), *engine_models.values()}
    if contract and contract.model is not None and len(served) > 1:
        problems.add(
            "engine_contract.model",
            "pins one model for every engine, but this fleet names several ("
            + ", ".join(sorted(served))
            + "): leave it out, each engine's model is checked on its own",
        )
    elif (
        contract
        and contract.model is not None
        and contract.model != model
        and not problems.failed("model", "engine_contract.model")
    ):
        problems.add(
            "engine_contract.model",
            f"must equal model ({show(model)}), got {show(contract.model)}",
        )
    if problems.messages:
        raise ConfigError(problems.messages, source)
    return config


def _default_model(
    named: str | None,
    models: tuple[ModelConfig, ...],
    engine_models: Iterable[str],
    problems: Problems,
) -> str:
    """The top-level `model`, else the first model `[[models]]` or an engine names."""
    if named:
        return named
    for name in (*(m.name for m in models), *engine_models):
        if name:
            return name
    return ""


def _names_models(raw: Mapping[object, object]) -> bool:
    """Whether `[[models]]` or an engine entry names a model, so the top-level `model` may
    be left out."""
    listed = raw.get("models")
    engines = raw.get("engines")
    return bool(listed) or (
        isinstance(engines, list)
        and any(isinstance(entry, Mapping) and "model" in entry for entry in engines)
    )


def _check_model_timeouts(config: Config, problems: Problems) -> None:
    """A model's own leg bounds fit the request deadline, as `[engine]`'s must."""
    bound = config.serving.request_timeout_s
    for index, model in enumerate(config.models):
        for key, value in model.engine.items():
            path = f"models[{index}].engine.{key}"
            if value > bound and not problems.failed(path, "serving.request_timeout_s"):
                problems.add(
                    path, f"must not exceed serving.request_timeout_s ({bound:g}), got {value:g}"
                )


def _server(table: Table) -> ServerConfig:
    d = ServerConfig()
    server = ServerConfig(
        host=table.string("host", d.host),
        port=table.integer("port", d.port, 0, 65535),
        graceful_timeout_s=table.number("graceful_timeout_s", d.graceful_timeout_s, zero_ok=True),
        client_timeout_s=table.number("client_timeout_s", d.client_timeout_s),
        api_keys=table.strings("api_keys", secret=True),
        admin_api_keys=table.strings("admin_api_keys", secret=True),
        api_keys_env=env_name(table, "api_keys_env"),
        admin_api_keys_env=env_name(table, "admin_api_keys_env"),
        workers=parse_workers(table),
        replicas=parse_replicas(table),
    )
    table.close()
    return server


def _engine(table: Table) -> EngineConfig:
    d = EngineConfig()
    engine = EngineConfig(
        first_token_timeout_s=table.number("first_token_timeout_s", d.first_token_timeout_s),
        decode_read_timeout_s=table.number(
            "decode_read_timeout_s", d.decode_read_timeout_s, zero_ok=True
        ),
        prefill_timeout_s=table.number("prefill_timeout_s", d.prefill_timeout_s),
        connect_timeout_s=table.number("connect_timeout_s", d.connect_timeout_s),
        health_timeout_s=table.number("health_timeout_s", d.health_timeout_s),
        metrics_interval_s=table.number("metrics_interval_s", d.metrics_interval_s, zero_ok=True),
        kv_lease_s=table.number("kv_lease_s", d.kv_lease_s),
        release_abandoned=table.boolean("release_abandoned", d.release_abandoned),
        nonstream_decode=table.choice("nonstream_decode", NonstreamDecode, d.nonstream_decode),
        whole_answer_timeout_s=table.number(
            "whole_answer_timeout_s", d.whole_answer_timeout_s, zero_ok=True
        ),
        api_key_env=env_name(table, "api_key_env"),
        ca_bundle=table.optional_string("ca_bundle"),
    )
    table.close()
    return engine


def _serving(table: Table) -> ServingConfig:
    d = ServingConfig()
    serving = ServingConfig(
        request_timeout_s=table.number("request_timeout_s", d.request_timeout_s),
        max_attempts=table.integer("max_attempts", d.max_attempts, 1),
        retry_budget=table.integer("retry_budget", d.retry_budget, 0),
        retry_replenish=table.number("retry_replenish", d.retry_replenish, zero_ok=True),
        max_request_bytes=table.integer("max_request_bytes", d.max_request_bytes, 1),
        queue_capacity=table.integer("queue_capacity", d.queue_capacity, 0),
        queue_timeout_s=table.number("queue_timeout_s", d.queue_timeout_s),
    )
    table.close()
    return serving


def _recovery(table: Table) -> RecoveryConfig:
    d = RecoveryConfig()
    recovery = RecoveryConfig(
        eject_after=table.integer("eject_after", d.eject_after, 1),
        max_ejected_fraction=table.fraction("max_ejected_fraction", d.max_ejected_fraction),
        readmit_interval_s=table.number("readmit_interval_s", d.readmit_interval_s),
        urgent_readmit_interval_s=table.number(
            "urgent_readmit_interval_s", d.urgent_readmit_interval_s
        ),
        failure_quarantine_s=table.number(
            "failure_quarantine_s", d.failure_quarantine_s, zero_ok=True
        ),
        restart_policy=table.choice("restart_policy", RestartPolicy, d.restart_policy),
    )
    table.close()
    return recovery


def _journal(table: Table) -> JournalConfig:
    journal = JournalConfig(path=table.optional_string("path"))
    table.close()
    return journal


# --- Cross-field checks --------------------------------------------------------------------


# Keys whose default may not fit beside another key's value: (table, key, bounding table, key).
# An unset key takes the smaller of its default and the bound; only explicit values conflict.
_BOUNDED: Final = (
    ("engine", "first_token_timeout_s", "serving", "request_timeout_s"),
    ("engine", "prefill_timeout_s", "serving", "request_timeout_s"),
    ("engine", "decode_read_timeout_s", "serving", "request_timeout_s"),
    ("engine", "whole_answer_timeout_s", "serving", "request_timeout_s"),
    ("serving", "queue_timeout_s", "serving", "request_timeout_s"),
    ("recovery", "urgent_readmit_interval_s", "recovery", "readmit_interval_s"),
)


def _explicit(raw: Mapping[object, object], table: str, key: str) -> bool:
    section = raw.get(table)
    return isinstance(section, Mapping) and key in section


def _derive_defaults(config: Config, raw: Mapping[object, object]) -> Config:
    """Clamp unset values that depend on another key to what that key allows; the clamped
    key paths are listed in `Config.derived`."""
    derived = []
    for table, key, bound_table, bound_key in _BOUNDED:
        if _explicit(raw, table, key):
            continue
        section = getattr(config, table)
        bound = getattr(getattr(config, bound_table), bound_key)
        if getattr(section, key) > bound:
            config = replace(config, **{table: replace(section, **{key: bound})})
            derived.append(f"{table}.{key}")
    return replace(config, derived=tuple(derived))


def _check_timeouts(config: Config, problems: Problems) -> None:
    """Explicit values that another explicit (or default) value makes unreachable."""
    for table, key, bound_table, bound_key in _BOUNDED:
        path, bound_path = f"{table}.{key}", f"{bound_table}.{bound_key}"
        value = getattr(getattr(config, table), key)
        bound = getattr(getattr(config, bound_table), bound_key)
        if value > bound and not problems.failed(path, bound_path):
            problems.add(path, f"must not exceed {bound_path} ({bound:g}), got {value:g}")


def _check_engines(
    engines: Mapping[str, EngineSpec],
    complete: bool,
    server: ServerConfig,
    problems: Problems,
    discovered: bool = False,
) -> None:
    """The fleet as a whole: non-empty, both legs servable, no engine listed twice.

    `engines` maps each entry's key path to its spec; `complete` is False when an entry was
    not a table and so is missing from it. With `discovered`, pods may supply any phase.
    """
    if not engines:
        if complete and not discovered:
            problems.add("engines", "at least one engine is required")
        return
    seen_ids: set[str] = set()
    seen_urls: set[tuple[str, str, int]] = set()
    for path, spec in engines.items():
        if not problems.failed(f"{path}.id"):
            if spec.id in seen_ids:
                problems.add(f"{path}.id", f"duplicate engine id {show(spec.id)}")
            seen_ids.add(spec.id)
        if not problems.failed(f"{path}.url"):
            address = url_address(spec.url)
            if address in seen_urls:
                problems.add(f"{path}.url", f"duplicate engine url {show(spec.url)}")
            seen_urls.add(address)
            if is_router_address(address, server) and not problems.failed("server"):
                problems.add(
                    f"{path}.url",
                    f"points at the router itself (server.host {show(server.host)}, "
                    f"server.port {server.port}), got {show(spec.url)}",
                )
    # A stand-in role must not decide whether the fleet can serve a leg.
    if discovered or not complete or any(problems.failed(f"{path}.role") for path in engines):
        return
    if not any(spec.starting_role.can_prefill for spec in engines.values()):
        problems.add("engines", 'no engine may prefill: give one the role "prefill" or "both"')
    if not any(spec.starting_role.can_decode for spec in engines.values()):
        problems.add("engines", 'no engine may decode: give one the role "decode" or "both"')


def is_router_address(address: tuple[str, str, int], server: ServerConfig) -> bool:
    """Whether an engine address is the router's own listening address (a request loop)."""
    _, host, port = address
    listen = server.host.lower().strip("[]")
    if port != server.port:
        return False
    return host == listen or (host in _LOOPBACK and listen in _LOOPBACK | _WILDCARD)

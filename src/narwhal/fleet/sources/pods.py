"""What engine pods mean to the fleet: a pure reading of each pod and a pure difference.

A pod, as the Kubernetes API sends it (JSON), becomes a `PodView`: the engine it is (id =
pod name, url = its IP and port, role and seat limits from annotations or labels) and
whether it may take work:

| the pod                                           | view                                    |
|---------------------------------------------------|-----------------------------------------|
| no IP yet                                         | no engine ("no pod IP yet")             |
| no role (annotation or label `role_key`, nor a    | no engine, the reason says why          |
|   `default_role`), a bad role, port or seat count |                                         |
| a name longer than an engine id allows (64)       | no engine                               |
| being deleted (`deletionTimestamp`)               | the engine, not ready ("terminating")   |
| not `Running`, or its `Ready` condition not True  | the engine, not ready                   |
| otherwise                                         | the engine, ready                       |

`plan` then compares the views with the engines discovery holds in the fleet, by id:

| pod                     | engine in the fleet                 | step                             |
|-------------------------|-------------------------------------|----------------------------------|
| ready                   | none                                | add (readmission judges it       |
|                         |                                     |   before it takes work)          |
| ready                   | same url, drained by discovery or   | undrain                          |
|                         |   on its way out                    |                                  |
| ready                   | same url, other role or seat limits | change in place                  |
| ready or not            | another url (a new pod, same name)  | remove; the new one is added     |
|                         |                                     |   once the old one is gone       |
| not ready, or no engine | in service                          | drain: its requests finish       |
| gone (or not selected)  | any                                 | remove: drain, delete once idle  |

A pod whose url another engine in the fleet has (a static one, or a deleted pod's engine
still draining) waits, skipped with that reason, until the url is free. Discovery never
undrains an engine an operator drained.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from narwhal.config.discovery import DiscoveryConfig
from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.engines import same_engine_url

_ENGINE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
# What `EngineSpec` fields discovery sets, and so may change in place.
CHANGEABLE = ("role", "max_prefill_seats", "max_decode_seats")
# Seat limits of a pod that names none: an `[[engines]]` entry's defaults.
_DEFAULTS = EngineSpec("", "", Role.BOTH)


@dataclass(frozen=True, slots=True)
class PodView:
    """One pod as the fleet sees it; `spec` None: it is not (yet) an engine."""

    name: str
    spec: EngineSpec | None
    ready: bool
    reason: str


def read_pod(pod: Mapping[str, Any], config: DiscoveryConfig) -> PodView:
    """The engine a pod is, and whether it may take work (the table above)."""
    meta = _mapping(pod.get("metadata"))
    status = _mapping(pod.get("status"))
    name = str(meta.get("name", ""))
    if not _ENGINE_ID.fullmatch(name):
        return PodView(name, None, False, "its name is not a valid engine id (64 characters)")
    ip = status.get("podIP")
    if not isinstance(ip, str) or not ip:
        return PodView(name, None, False, "no pod IP yet")
    labels = _mapping(meta.get("labels"))
    annotations = _mapping(meta.get("annotations"))

    def setting(key: str) -> str | None:
        value = annotations.get(key, labels.get(key))
        return value if isinstance(value, str) else None

    role_text = setting(config.role_key) or config.default_role
    if role_text is None:
        return PodView(name, None, False, f"no role: annotation or label {config.role_key}")
    try:
        role = Role(role_text)
    except ValueError:
        return PodView(name, None, False, f"{config.role_key} is {role_text!r}: not a role")
    port = _port(pod, config, setting(config.port_key))
    if isinstance(port, str):
        return PodView(name, None, False, port)
    seats: list[int] = []
    for key, default in (
        (config.prefill_seats_key, _DEFAULTS.max_prefill_seats),
        (config.decode_seats_key, _DEFAULTS.max_decode_seats),
    ):
        text = setting(key)
        if text is not None and not text.isdigit():
            return PodView(name, None, False, f"{key} is {text!r}: not a seat count")
        seats.append(default if text is None else int(text))
    host = f"[{ip}]" if ":" in ip else ip
    url = f"{config.scheme.value}://{host}:{port}"
    spec = EngineSpec(
        name,
        url,
        role,
        max_prefill_seats=seats[0],
        max_decode_seats=seats[1],
        model=setting(config.model_key) or None,
    )
    if meta.get("deletionTimestamp"):
        return PodView(name, spec, False, "terminating")
    phase = status.get("phase")
    if phase != "Running":
        return PodView(name, spec, False, f"phase {phase}")
    if not _ready(status):
        return PodView(name, spec, False, "not ready")
    return PodView(name, spec, True, "ready")


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


def _port(pod: Mapping[str, Any], config: DiscoveryConfig, annotated: str | None) -> int | str:
    """The engine's port, or why there is none."""
    if annotated is not None:
        if annotated.isdigit() and 1 <= int(annotated) <= 65535:
            return int(annotated)
        return f"{config.port_key} is {annotated!r}: not a port"
    if config.port_name is None:
        return config.port
    spec = _mapping(pod.get("spec"))
    for container in spec.get("containers") or ():
        for port in _mapping(container).get("ports") or ():
            port = _mapping(port)
            if port.get("name") == config.port_name and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return f"no container port named {config.port_name}"


# The difference ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Held:
    """A discovered engine as the fleet holds it."""

    spec: EngineSpec
    # Out of placement: drained by anyone (discovery or an operator).
    draining: bool = False
    # Drained by discovery because its pod was not ready (discovery may undrain it).
    drained_here: bool = False
    # On its way out: deleted once drained.
    removing: bool = False


class Action(enum.StrEnum):
    ADD = "add"
    CHANGE = "change"
    DRAIN = "drain"
    UNDRAIN = "undrain"
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class Step:
    action: Action
    engine_id: str
    why: str
    # The spec to add, or to change to.
    spec: EngineSpec | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    steps: tuple[Step, ...] = ()
    # Pods that are engines but wait (a url still taken), by name: why.
    waiting: Mapping[str, str] | None = None


def plan(held: Mapping[str, Held], pods: Mapping[str, PodView], others: Mapping[str, str]) -> Plan:
    """The steps that make the discovered engines follow the pods (the table above).

    `held`: the engines discovery holds, by id; `pods`: every selected pod's view, by name;
    `others`: every other engine in the fleet, id to url.
    """
    steps: list[Step] = []
    waiting: dict[str, str] = {}
    urls = {**others, **{engine_id: h.spec.url for engine_id, h in held.items()}}
    for name, view in pods.items():
        spec = view.spec
        engine = held.get(name)
        if spec is None or not view.ready:
            if engine is not None and not engine.draining and not engine.removing:
                steps.append(Step(Action.DRAIN, name, f"pod {name}: {view.reason}"))
            continue
        if engine is None:
            if name in others:
                waiting[name] = f"engine id {name} is a configured engine's"
                continue
            clash = next(
                (other for other, url in urls.items() if same_engine_url(url, spec.url)), None
            )
            if clash is not None:
                waiting[name] = f"url {spec.url} is still engine {clash}'s"
                continue
            steps.append(Step(Action.ADD, name, f"pod {name} is ready", spec))
            urls[name] = spec.url
        elif engine.spec.url != spec.url:
            if not engine.removing:
                steps.append(
                    Step(
                        Action.REMOVE,
                        name,
                        f"pod {name} now at {spec.url}: the engine at {engine.spec.url} goes first",
                    )
                )
            waiting[name] = f"its old engine at {engine.spec.url} is still draining"
        else:
            if engine.removing or engine.drained_here:
                steps.append(Step(Action.UNDRAIN, name, f"pod {name} is ready again"))
            changed = [k for k in CHANGEABLE if getattr(engine.spec, k) != getattr(spec, k)]
            if changed:
                steps.append(
                    Step(Action.CHANGE, name, f"pod {name}: {', '.join(changed)} changed", spec)
                )
    for engine_id, engine in held.items():
        if engine_id not in pods and not engine.removing:
            steps.append(
                Step(Action.REMOVE, engine_id, f"pod {engine_id} is gone (deleted or unselected)")
            )
    return Plan(tuple(steps), waiting)

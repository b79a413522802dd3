"""What the fleet tells its listeners: an engine event, for the journal, metrics and logs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """A change in an engine's standing, for the journal, metrics and logs."""

    # Its lifecycle's (see `lifecycle`): "added", "quarantined", "spared", "ejected",
    # "readmitted", "draining", "drained", "removed"; readmission's "probe"; an
    # operator's "changed"; the role controller's "role_change" and "role_advice";
    # "silent_recompute" (see `engine_reports`); "model" when what an engine serves
    # changed (`engine_models`); "adapter_loaded", "adapter_load_failed" and
    # "adapter_unloaded" (`adapters`).
    kind: str
    engine: str
    detail: str = ""
    result: str | None = None  # probes: "success", "failure", "inconclusive"
    # The role controller's "role_change" and "role_advice": why, and what it measured.
    reason: str | None = None
    inputs: Mapping[str, object] | None = field(default=None, compare=False, hash=False)


EventListener = Callable[[EngineEvent], None]

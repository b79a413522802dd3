"""Discovery as one more source of engines: the pods the watcher reports become fleet
changes through `operations`, the same path an operator's and a reload's changes take.

Placement never asks where an engine came from. Discovery keeps to the engines it added
(`Engine.source`), as a reload keeps to the file's: a pod that turns unready is drained
(its requests finish), one deleted is drained and then removed once idle, one ready is
added and, like any added engine, judged by readmission before it takes work. The rules
are `narwhal.fleet.sources.pods`; a failing API never empties the fleet (the watcher keeps its
last pod table and retries). With `--workers N` each worker runs its own watcher over its
own fleet table: all watch the same pods, so they converge on the same engines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from narwhal.config.discovery import DiscoveryConfig
from narwhal.fleet.operations import FleetOperations
from narwhal.fleet.sources.pods import Action, Held, PodView, Step, plan, read_pod
from narwhal.fleet.table import EngineEvent, Fleet
from narwhal.runtime.background import Spawn

SOURCE = "kubernetes"


class FleetDiscovery:
    """Keeps the fleet's discovered engines following the selected pods."""

    def __init__(self, config: DiscoveryConfig, fleet: Fleet, operations: FleetOperations) -> None:
        try:  # the optional client, imported only when discovery is on
            from narwhal.fleet.sources.kubernetes import PodWatcher
        except ImportError as error:
            raise RuntimeError(
                f"[discovery] needs the Kubernetes client ({error.name}): "
                "pip install 'narwhal[kubernetes]'"
            ) from error

        self.config = config
        self.fleet = fleet
        self.operations = operations
        self.watcher = PodWatcher(config, self.pods_changed)
        self.views: dict[str, PodView] = {}
        # Pods waiting to become engines, by name: why.
        self.waiting: dict[str, str] = {}
        # Engines discovery drained because their pod was not ready.
        self._drained_here: set[str] = set()
        self.changes: dict[Action, int] = {action: 0 for action in Action}
        self._task: asyncio.Task[None] | None = None
        fleet.listeners.append(self._on_event)

    def start(self, spawn: Spawn) -> None:
        """Follow the pods, in a task `spawn` starts (the router's background)."""
        self._task = spawn(self.watcher.run(), "discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def pods_changed(self, pods: Mapping[str, Mapping[str, Any]]) -> None:
        """The watcher's whole pod table, after each change."""
        self.views = {name: read_pod(pod, self.config) for name, pod in pods.items()}
        self.reconcile()

    def reconcile(self) -> None:
        """Apply the steps that make the discovered engines follow the pods."""
        held: dict[str, Held] = {}
        others: dict[str, str] = {}
        for engine in self.fleet.engines:
            if engine.source != SOURCE:
                others[engine.id] = engine.url
                continue
            held[engine.id] = Held(
                engine.spec,
                draining=engine.draining,
                drained_here=engine.draining and engine.id in self._drained_here,
                removing=engine.remove_when_drained,
            )
        result = plan(held, self.views, others)
        self.waiting = dict(result.waiting or {})
        for step in result.steps:
            self._apply(step)

    def _apply(self, step: Step) -> None:
        self.changes[step.action] += 1
        ops, why = self.operations, f"discovery: {step.why}"
        if step.action is Action.ADD:
            assert step.spec is not None
            ops.add_from(SOURCE, step.spec, why)
            return
        engine = self.fleet.by_id[step.engine_id]
        if step.action is Action.CHANGE:
            assert step.spec is not None
            ops.change_for(engine, step.spec, why)
        elif step.action is Action.DRAIN:
            self._drained_here.add(engine.id)
            ops.drain_for(engine, why)
        elif step.action is Action.UNDRAIN:
            self._drained_here.discard(engine.id)
            ops.undrain_for(engine, why)
        else:
            ops.retire(engine, why)

    def _on_event(self, event: EngineEvent) -> None:
        """A removed engine may free the url or id a waiting pod needs."""
        if event.kind == "removed":
            self._drained_here.discard(event.engine)
            if self.waiting:
                asyncio.get_running_loop().call_soon(self.reconcile)

    # What operators see -------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """`discovery` in `/narwhal/state`."""
        status = self.watcher.status
        return {
            "enabled": True,
            "kind": self.config.kind,
            "namespace": self.config.namespace,
            "label_selector": self.config.label_selector,
            "synced": status.synced,
            "last_sync_age_s": self._sync_age(),
            "resource_version": status.resource_version,
            "events": dict(status.events),
            "lists": dict(status.lists),
            "failures": status.failures,
            "last_error": status.last_error,
            "changes": {action.value: n for action, n in self.changes.items()},
            "pods": {
                name: {"ready": view.ready, "engine": view.spec is not None, "reason": view.reason}
                for name, view in sorted(self.views.items())
            },
            "waiting": dict(self.waiting),
        }

    def _sync_age(self) -> float | None:
        last = self.watcher.status.last_sync
        if last is None:
            return None
        return round(asyncio.get_running_loop().time() - last, 3)

    def metrics(self) -> Iterator[Metric]:
        """The watcher's work and the fleet changes it made, read when scraped."""
        status = self.watcher.status
        events = CounterMetricFamily(
            "narwhal_discovery_events",
            "Watch events received from the Kubernetes API, by type.",
            labels=["type"],
        )
        for kind, count in status.events.items():
            events.add_metric([kind], count)
        lists = CounterMetricFamily(
            "narwhal_discovery_lists",
            "Full pod lists: at start, after 410 Gone (expired), after a failure.",
            labels=["reason"],
        )
        for reason in ("start", "expired", "failure"):
            lists.add_metric([reason], status.lists.get(reason, 0))
        changes = CounterMetricFamily(
            "narwhal_discovery_changes",
            "Fleet changes discovery made, by action.",
            labels=["action"],
        )
        for action, count in self.changes.items():
            changes.add_metric([action.value], count)
        yield events
        yield lists
        yield changes
        yield CounterMetricFamily(
            "narwhal_discovery_failures",
            "Failed lists and watches (the last known pods were kept).",
            value=status.failures,
        )
        age = self._sync_age()
        yield GaugeMetricFamily(
            "narwhal_discovery_last_sync_age_seconds",
            "Seconds since the last list, watch event or watch renewal that succeeded.",
            value=-1 if age is None else age,
        )
        yield GaugeMetricFamily(
            "narwhal_discovery_synced",
            "1 while the pod table is the API's current view; 0 after a failure until a list.",
            value=1 if status.synced else 0,
        )
        pods = GaugeMetricFamily(
            "narwhal_discovery_pods",
            "Selected pods: ready engines, engines not ready, pods that are not engines.",
            labels=["view"],
        )
        views = list(self.views.values())
        pods.add_metric(["ready"], sum(v.ready for v in views))
        pods.add_metric(["not_ready"], sum(v.spec is not None and not v.ready for v in views))
        pods.add_metric(["not_engine"], sum(v.spec is None for v in views))
        yield pods

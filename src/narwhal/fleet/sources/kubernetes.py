"""The pod watcher: list, then watch, the selected pods through the Kubernetes API.

The official asynchronous client (`kubernetes_asyncio`) does the HTTP, the credentials and
the watch framing; this module keeps the protocol's state:

| happening                                  | what the watcher does                          |
|--------------------------------------------|------------------------------------------------|
| start, or after a failure                  | list the pods (the whole truth), remember the  |
|                                            |   list's resourceVersion, then watch from it   |
| ADDED / MODIFIED / DELETED                 | update the pod table, report it, keep the      |
|                                            |   event's resourceVersion                      |
| BOOKMARK                                   | keep its resourceVersion                       |
| the watch ends (`watch_timeout_s`)         | watch again from the last resourceVersion      |
| 410 Gone (that version was compacted)      | list again                                     |
| any other failure (refused, 5xx, 401, bad  | keep the last pod table (the fleet keeps its   |
|   JSON, a dropped stream)                  |   engines), log, list again after a backoff    |
|                                            |   doubling from `backoff_s` to `max_backoff_s` |

Every change to the table is reported through `on_change` with the whole table, whose
reading is pure (`narwhal.fleet.sources.pods`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch

from narwhal.config.discovery import Credentials, DiscoveryConfig

log = logging.getLogger("narwhal.discovery")

Pods = Mapping[str, Mapping[str, Any]]
# A list answers within this (seconds); a watch within its own timeout and this.
LIST_TIMEOUT_S = 30.0
EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")


@dataclass(slots=True)
class WatchStatus:
    """What the watcher has done, for `/narwhal/state` and `/metrics`."""

    # Whether the pod table is the API's current view (a list succeeded, no failure since).
    synced: bool = False
    # Event-loop time of the last list, event or watch renewal that succeeded; None: never.
    last_sync: float | None = None
    resource_version: str | None = None
    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_TYPES, 0))
    # Lists by why: "start", "expired" (410 Gone), "failure" (after a backoff).
    lists: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    last_error: str | None = None


class PodWatcher:
    """Keeps `pods` (name to the pod's JSON) following the API; reports each change."""

    def __init__(
        self,
        config: DiscoveryConfig,
        on_change: Callable[[Pods], None],
        status: WatchStatus | None = None,
    ) -> None:
        self.config = config
        self.on_change = on_change
        self.status = status or WatchStatus()
        self.pods: dict[str, Mapping[str, Any]] = {}

    async def run(self) -> None:
        """List and watch until cancelled; failures are retried, never raised."""
        why = "start"
        backoff = self.config.backoff_s
        while True:
            try:
                async with await self._api_client() as api:
                    core = k8s.CoreV1Api(api)
                    while True:
                        version = await self._list(core, why)
                        backoff = self.config.backoff_s
                        await self._watch(core, version)
                        why = "expired"
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self._failed(error)
                why = "failure"
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.max_backoff_s)

    async def _api_client(self) -> k8s.ApiClient:
        """A client configured as `[discovery] credentials` says."""
        configuration = k8s.Configuration()
        mode = self.config.credentials
        in_cluster = mode is Credentials.IN_CLUSTER
        if mode is Credentials.AUTO:
            try:
                k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration
                )
                in_cluster = True
            except k8s_config.ConfigException:
                pass
        elif in_cluster:
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        if not in_cluster:
            await k8s_config.load_kube_config(
                config_file=self.config.kubeconfig,
                context=self.config.context,
                client_configuration=configuration,
            )
        return k8s.ApiClient(configuration)

    async def _list(self, core: k8s.CoreV1Api, why: str) -> str:
        """Replace the pod table with a fresh list; its resourceVersion."""
        # Unparsed (`_preload_content=False`): the raw response, read as JSON.
        response: aiohttp.ClientResponse = await core.list_namespaced_pod(  # type: ignore[assignment]
            self.config.namespace,
            label_selector=self.config.label_selector,
            _preload_content=False,
            _request_timeout=LIST_TIMEOUT_S,
        )
        try:
            if not 200 <= response.status <= 299:
                raise ApiException(status=response.status, reason=response.reason)
            body = orjson.loads(await response.read())
        finally:
            response.release()
        version = str(body["metadata"]["resourceVersion"])
        self.pods = {_name(pod): pod for pod in body.get("items") or ()}
        status = self.status
        status.lists[why] = status.lists.get(why, 0) + 1
        status.synced, status.resource_version = True, version
        self._synced()
        log.info(
            "discovery: listed %d pods in %s matching %s (resourceVersion %s)",
            len(self.pods),
            self.config.namespace,
            self.config.label_selector,
            version,
        )
        self.on_change(self.pods)
        return version

    async def _watch(self, core: k8s.CoreV1Api, version: str) -> None:
        """Watch from `version`, renewing the watch as it times out; returns on 410 Gone."""
        timeout = self.config.watch_timeout_s
        while True:
            watch = Watch()
            try:
                stream = watch.stream(
                    core.list_namespaced_pod,
                    self.config.namespace,
                    label_selector=self.config.label_selector,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=timeout,
                    _request_timeout=aiohttp.ClientTimeout(
                        total=timeout + LIST_TIMEOUT_S, sock_connect=LIST_TIMEOUT_S
                    ),
                )
                async for event in stream:
                    version = self._event(event) or version
            except ApiException as error:
                if error.status != 410:
                    raise
                log.info("discovery: resourceVersion %s expired (410 Gone): listing again", version)
                return
            finally:
                await watch.close()
            self._synced()

    def _event(self, event: Mapping[str, Any]) -> str | None:
        """Apply one watch event; the resourceVersion it brings."""
        kind = str(event.get("type"))
        pod = event.get("raw_object")
        if not isinstance(pod, Mapping):
            raise ValueError(f"a watch event of type {kind} without an object")
        self.status.events[kind] = self.status.events.get(kind, 0) + 1
        version = pod.get("metadata", {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            self.pods[_name(pod)] = pod
        elif kind == "DELETED":
            self.pods.pop(_name(pod), None)
        if version is not None:
            self.status.resource_version = str(version)
        self._synced()
        if kind != "BOOKMARK":
            self.on_change(self.pods)
        return None if version is None else str(version)

    def _synced(self) -> None:
        self.status.last_sync = asyncio.get_running_loop().time()

    def _failed(self, error: Exception) -> None:
        status = self.status
        status.synced = False
        status.failures += 1
        status.last_error = _describe(error)
        log.warning(
            "discovery: %s; keeping the last %d pods, retrying", status.last_error, len(self.pods)
        )


def _name(pod: Mapping[str, Any]) -> str:
    return str(pod["metadata"]["name"])


def _describe(error: Exception) -> str:
    if isinstance(error, ApiException):
        return f"the API answered {error.status} {error.reason}".strip()
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__

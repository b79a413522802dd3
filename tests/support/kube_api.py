"""A stand-in Kubernetes API server for discovery's tests: the pods part of core/v1.

No kube-apiserver (nor etcd beside it) can be installed from the package registries this
project uses, so this speaks just what a pod watcher needs, as the real server does:

- `GET /api/v1/namespaces/{ns}/pods?labelSelector=...`: a `PodList` with the list's
  `metadata.resourceVersion`;
- the same with `watch=true&resourceVersion=N`: a chunked stream of one JSON event per line
  (`ADDED`, `MODIFIED`, `DELETED`, and `BOOKMARK` when `allowWatchBookmarks`), every change
  after N in order, then live ones, ended after `timeoutSeconds`. A pod that stops matching
  the selector is `DELETED` for that watch, one that starts matching `ADDED`;
- a watch from a version older than the last compaction gets one `ERROR` event carrying a
  410 `Status` ("Expired"), as the real server sends once etcd has compacted it;
- a bearer token is required (401 `Status` otherwise).

Pods are made with the official client's models (`kubernetes.client.V1Pod`) and serialized
by its own `ApiClient`, so their field names are the API's. Tests change pods through the
methods below and may make the next requests fail (`fail_next`) or cut every open watch
(`cut_watches`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from kubernetes import client as models

TOKEN = "discovery-test-token"
_SERIALIZER = models.ApiClient()


def pod(
    name: str,
    port: int,
    role: str | None,
    *,
    ready: bool = True,
    ip: str | None = "127.0.0.1",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An engine pod as the API serializes it: role and port as annotations."""
    notes = {"narwhal/port": str(port), **(annotations or {})}
    if role is not None:
        notes["narwhal/role"] = role
    body = models.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=models.V1ObjectMeta(
            name=name,
            namespace="engines",
            uid=f"uid-{name}",
            labels={"app": "vllm", **(labels or {})},
            annotations=notes,
        ),
        spec=models.V1PodSpec(
            containers=[
                models.V1Container(
                    name="vllm",
                    image="vllm/vllm-openai",
                    ports=[models.V1ContainerPort(name="http", container_port=port)],
                )
            ]
        ),
        status=models.V1PodStatus(
            phase="Running",
            pod_ip=ip,
            conditions=[models.V1PodCondition(type="Ready", status="True" if ready else "False")],
        ),
    )
    serialized: dict[str, Any] = _SERIALIZER.sanitize_for_serialization(body)  # type: ignore[no-untyped-call]
    return serialized


def set_ready(body: dict[str, Any], ready: bool) -> None:
    for condition in body["status"]["conditions"]:
        if condition["type"] == "Ready":
            condition["status"] = "True" if ready else "False"


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based selectors: `a=b`, `a==b`, `a!=b`, `a` (exists), comma-joined."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class KubeApi:
    """The stand-in server; `url` once started; pods live in namespace `engines`."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 100
        # Every change: (resourceVersion, the pod before or None, the pod after or None).
        self.history: list[tuple[int, dict[str, Any] | None, dict[str, Any] | None]] = []
        self.compacted = 0
        self._failures: list[int] = []
        self._changed = asyncio.Condition()
        # Each open watch's stop signal, and whether it ends abruptly (a dropped connection).
        self._watches: dict[asyncio.Event, list[bool]] = {}
        self.requests: list[str] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.cut_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, directory: Path) -> Path:
        """A kubeconfig file pointing the real client at this server."""
        path = directory / "kubeconfig"
        path.write_text(
            orjson.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "narwhal", "user": {"token": TOKEN}}],
                    "contexts": [
                        {
                            "name": "test",
                            "context": {
                                "cluster": "test",
                                "user": "narwhal",
                                "namespace": "engines",
                            },
                        }
                    ],
                    "current-context": "test",
                }
            ).decode()
        )
        return path

    # Changing the world ------------------------------------------------------------

    async def put(self, body: dict[str, Any]) -> None:
        """Create or replace a pod (ADDED or MODIFIED)."""
        name = body["metadata"]["name"]
        await self._record(self.pods.get(name), body)

    async def change(self, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
        """MODIFIED: `edit` changes a copy of the pod."""
        after = orjson.loads(orjson.dumps(self.pods[name]))
        edit(after)
        await self._record(self.pods[name], after)

    async def terminate(self, name: str) -> None:
        """A graceful deletion begins: deletionTimestamp set, not ready (MODIFIED)."""

        def ending(body: dict[str, Any]) -> None:
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            body["metadata"]["deletionTimestamp"] = now
            set_ready(body, False)

        await self.change(name, ending)

    async def delete(self, name: str) -> None:
        """The pod is gone (DELETED)."""
        await self._record(self.pods[name], None)

    def compact(self) -> None:
        """Forget the history so far: watches from older versions get 410 Gone."""
        self.compacted = self.version
        self.history.clear()

    def fail_next(self, *statuses: int) -> None:
        """The next requests (lists or watches) answer these statuses."""
        self._failures.extend(statuses)

    def cut_watches(self) -> None:
        """End every open watch stream abruptly (a dropped connection)."""
        for stop, abrupt in self._watches.items():
            abrupt[0] = True
            stop.set()

    def end_watches(self) -> None:
        """End every open watch cleanly and at once, as its timeout would, sending nothing
        more: a change made now reaches the client only through its next watch or list."""
        for stop in self._watches:
            stop.set()

    async def _record(self, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        self.version += 1
        name = (after or before or {})["metadata"]["name"]
        if after is None:
            self.pods.pop(name, None)
            before = dict(before or {})
            before["metadata"] = {**before["metadata"], "resourceVersion": str(self.version)}
        else:
            after["metadata"]["resourceVersion"] = str(self.version)
            self.pods[name] = after
        self.history.append((self.version, before, after))
        async with self._changed:
            self._changed.notify_all()

    # Serving ------------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        self.requests.append(request.path_qs)
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return _json(_status(401, "Unauthorized", "Unauthorized"), 401)
        if self._failures:
            code = self._failures.pop(0)
            return _json(_status(code, "InternalError", "injected failure"), code)
        namespace = request.match_info["namespace"]
        selector = query.get("labelSelector", "")

        def selected(body: dict[str, Any] | None) -> bool:
            if body is None or body["metadata"].get("namespace") != namespace:
                return False
            return matches(selector, body["metadata"].get("labels") or {})

        # Go's ParseBool, as the real server reads it: the client sends "True".
        if query.get("watch", "").lower() not in ("true", "1", "t"):
            return _json(
                {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": [p for p in self.pods.values() if selected(p)],
                },
                200,
            )
        return await self._watch(request, selected)

    async def _watch(
        self, request: web.Request, selected: Callable[[dict[str, Any] | None], bool]
    ) -> web.StreamResponse:
        query = request.query
        since = int(query.get("resourceVersion") or self.version)
        timeout = float(query.get("timeoutSeconds", "1800"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since < self.compacted:
            message = f"too old resource version: {since} ({self.compacted})"
            await _send(response, "ERROR", _status(410, "Expired", message))
            return response
        cut = asyncio.Event()
        abrupt = [False]
        self._watches[cut] = abrupt
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        sent = since
        try:
            while loop.time() < until and not cut.is_set():
                for version, before, after in [h for h in self.history if h[0] > sent]:
                    was, now = selected(before), selected(after)
                    if now and after is not None:
                        await _send(response, "MODIFIED" if was else "ADDED", after)
                    elif was and before is not None:
                        gone = after or before
                        gone = {**gone, "metadata": {**gone["metadata"]}}
                        gone["metadata"]["resourceVersion"] = str(version)
                        await _send(response, "DELETED", gone)
                    sent = version
                if (
                    query.get("allowWatchBookmarks", "").lower() in ("true", "1", "t")
                    and sent < self.version
                ):
                    sent = self.version
                    bookmark = {"kind": "Pod", "metadata": {"resourceVersion": str(sent)}}
                    await _send(response, "BOOKMARK", bookmark)
                async with self._changed:
                    waits = min(0.5, max(0.0, until - loop.time()))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), waits)
            if abrupt[0]:
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
        finally:
            self._watches.pop(cut, None)
        return response


async def _send(response: web.StreamResponse, kind: str, body: dict[str, Any]) -> None:
    await response.write(orjson.dumps({"type": kind, "object": body}) + b"\n")


def _json(body: dict[str, Any], status: int) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")

"""The pod watcher, with the official client, against the stand-in API server (`kube_api`):
list then watch, renewals, 410 Gone, and failures that keep the last known pods."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from narwhal.config.discovery import Credentials, DiscoveryConfig
from narwhal.fleet.sources.kubernetes import Pods, PodWatcher
from support.kube_api import KubeApi, pod, set_ready

WAIT_S = 30.0


@pytest.fixture
async def api() -> AsyncIterator[KubeApi]:
    server = KubeApi()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def watching(api: KubeApi, tmp_path: Path, **keys: Any) -> AsyncIterator[Seen]:
    config = DiscoveryConfig(
        enabled=True,
        namespace="engines",
        label_selector="app=vllm",
        credentials=Credentials.KUBECONFIG,
        kubeconfig=str(api.kubeconfig(tmp_path)),
        backoff_s=0.05,
        max_backoff_s=0.2,
        **keys,
    )
    seen = Seen()
    watcher = PodWatcher(config, seen.changed)
    seen.watcher = watcher
    task = asyncio.create_task(watcher.run())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Seen:
    """Every table the watcher reported, newest last."""

    def __init__(self) -> None:
        self.tables: list[dict[str, dict[str, Any]]] = []
        self.watcher: PodWatcher | None = None

    def changed(self, pods: Pods) -> None:
        self.tables.append({name: dict(body) for name, body in pods.items()})

    @property
    def last(self) -> dict[str, dict[str, Any]]:
        return self.tables[-1] if self.tables else {}

    async def until(self, check: Callable[[], bool], what: str) -> None:
        async with asyncio.timeout(WAIT_S):
            while not check():  # noqa: ASYNC110 (the watcher reports no event to wait on)
                await asyncio.sleep(0.02)


def ready_of(body: dict[str, Any]) -> bool:
    return any(c["status"] == "True" for c in body["status"]["conditions"])


async def test_it_lists_then_follows_every_change_with_its_token(
    api: KubeApi, tmp_path: Path
) -> None:
    await api.put(pod("p0", 8100, "prefill"))
    await api.put(pod("other", 8100, "prefill", labels={"app": "web"}))
    async with watching(api, tmp_path) as seen:
        await seen.until(lambda: set(seen.last) == {"p0"}, "the list")
        await api.put(pod("d0", 8200, "decode"))
        await seen.until(lambda: set(seen.last) == {"p0", "d0"}, "ADDED d0")
        await api.change("d0", lambda body: set_ready(body, False))
        await seen.until(lambda: not ready_of(seen.last["d0"]), "MODIFIED d0")
        await api.delete("p0")
        await seen.until(lambda: set(seen.last) == {"d0"}, "DELETED p0")
        # A pod whose labels stop matching leaves the selection.
        await api.change("d0", lambda body: body["metadata"]["labels"].update(app="web"))
        await seen.until(lambda: seen.last == {}, "d0 unselected")
        assert seen.watcher is not None
        status = seen.watcher.status
        assert status.synced and status.lists == {"start": 1} and status.failures == 0
        assert status.events["ADDED"] == 1 and status.events["DELETED"] == 2
        assert status.resource_version == str(api.version)
    assert all("labelSelector=app%3Dvllm" in path for path in api.requests)


async def test_a_watch_renewed_from_a_compacted_version_lists_again(
    api: KubeApi, tmp_path: Path
) -> None:
    await api.put(pod("p0", 8100, "prefill"))
    async with watching(api, tmp_path) as seen:
        await seen.until(lambda: set(seen.last) == {"p0"}, "the list")
        assert seen.watcher is not None
        status = seen.watcher.status
        await seen.until(lambda: len(api._watches) == 1, "the watch to open")
        api.end_watches()
        await api.put(pod("d0", 8200, "decode"))
        api.compact()
        await seen.until(lambda: set(seen.last) == {"p0", "d0"}, "d0 through a new list")
        assert status.lists == {"start": 1, "expired": 1} and status.failures == 0


async def test_a_renewed_watch_resumes_without_a_list(api: KubeApi, tmp_path: Path) -> None:
    async with watching(api, tmp_path, watch_timeout_s=1) as seen:
        await seen.until(lambda: seen.watcher is not None and seen.watcher.status.synced, "sync")
        await asyncio.sleep(2.5)  # at least two renewals
        await api.put(pod("d0", 8200, "decode"))
        await seen.until(lambda: set(seen.last) == {"d0"}, "d0 on a renewed watch")
        assert seen.watcher is not None and seen.watcher.status.lists == {"start": 1}
    assert sum("watch=true" in path.lower() for path in api.requests) >= 2


async def test_failures_keep_the_last_pods_and_are_retried(api: KubeApi, tmp_path: Path) -> None:
    await api.put(pod("p0", 8100, "prefill"))
    async with watching(api, tmp_path) as seen:
        await seen.until(lambda: set(seen.last) == {"p0"}, "the list")
        assert seen.watcher is not None
        status = seen.watcher.status
        reported = len(seen.tables)
        api.fail_next(500, 500, 503)
        api.cut_watches()
        await seen.until(lambda: status.failures >= 3, "three failed tries")
        assert len(seen.tables) == reported, "a failure reports no change"
        assert seen.watcher.pods.keys() == {"p0"}
        await seen.until(lambda: status.synced, "a list after the failures")
        assert status.lists.get("failure", 0) >= 1
        assert status.last_error is not None and "503" in status.last_error


async def test_a_wrong_token_is_a_failure_that_reports_nothing(
    api: KubeApi, tmp_path: Path
) -> None:
    await api.put(pod("p0", 8100, "prefill"))
    path = api.kubeconfig(tmp_path)
    path.write_text(path.read_text().replace("discovery-test-token", "wrong"))
    config = DiscoveryConfig(
        enabled=True,
        namespace="engines",
        label_selector="app=vllm",
        credentials=Credentials.KUBECONFIG,
        kubeconfig=str(path),
        backoff_s=0.05,
        max_backoff_s=0.1,
    )
    seen = Seen()
    watcher = PodWatcher(config, seen.changed)
    task = asyncio.create_task(watcher.run())
    try:
        await seen.until(lambda: watcher.status.failures >= 2, "failures")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert seen.tables == [] and not watcher.status.synced
    assert watcher.status.last_error == "the API answered 401 Unauthorized"

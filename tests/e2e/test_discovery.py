"""Engine pods coming, turning unready and going under steady load fail no request.

`narwhal serve` runs as its own process with `[discovery]` on and no `[[engines]]`, its
official Kubernetes client pointed by a kubeconfig at the stand-in API server of
`kube_api` (no real kube-apiserver can be installed here). The pods name simulated engines
on loopback, each by its own port annotation. Eight streaming `openai` clients send
requests throughout while pods are added, made unready and ready again, terminated and
deleted, the API's history is compacted under an open watch and the API fails for a
while; no request may fail, the fleet table follows the pods, and a reload of the config
file leaves discovered engines alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from openai import AsyncOpenAI

from narwhal.tools.sim.fleet import SimFleet
from support.kube_api import KubeApi, pod, set_ready
from support.load import WAIT_S, Load, until
from support.stack import FAST, MODEL, serve_process
from support.workers import post_fresh, serve_workers

# Long enough that drains meet requests still streaming there.
SIM = replace(FAST, inter_token_s=0.01)
NAMES = ("p0", "p1", "d0", "d1", "d2")
CLIENTS = 8


def fleet_file(path: Path, journal: Path, kubeconfig: Path) -> None:
    path.write_text(
        "\n".join(
            [
                f'model = "{MODEL}"',
                "[server]",
                "graceful_timeout_s = 10.0",
                "[journal]",
                f'path = "{journal}"',
                "[discovery]",
                "enabled = true",
                'namespace = "engines"',
                'label_selector = "app=vllm"',
                'credentials = "kubeconfig"',
                f'kubeconfig = "{kubeconfig}"',
                "backoff_s = 0.2",
                "max_backoff_s = 1.0",
            ]
        )
        + "\n"
    )


async def test_pods_added_drained_and_removed_under_load_fail_no_request(tmp_path: Path) -> None:
    api = KubeApi()
    await api.start()
    try:
        async with SimFleet([replace(SIM, name=name) for name in NAMES]) as sims:
            port = {n: int(sims.engines[i].url.rsplit(":", 1)[1]) for i, n in enumerate(NAMES)}
            received = {n: sims.engines[i].received for i, n in enumerate(NAMES)}
            await api.put(pod("p0", port["p0"], "prefill"))
            await api.put(pod("d0", port["d0"], "decode"))
            path, journal, log = tmp_path / "fleet.toml", tmp_path / "j.jsonl", tmp_path / "log"
            fleet_file(path, journal, api.kubeconfig(tmp_path))
            async with serve_process(path, log, env=dict(os.environ), wait_s=WAIT_S) as (
                process,
                router,
            ):
                sent = await exercise(api, process, router, port, received)
            assert process.returncode == 0, log.read_text()
    finally:
        await api.stop()
    lines = [orjson.loads(line) for line in journal.read_bytes().splitlines()]
    requests = [line for line in lines if line["type"] == "request"]
    assert len(requests) == sent and all(line["status"] == 200 for line in requests)
    events = [(line["event"], line["engine"]) for line in lines if line["type"] == "engine"]
    d0 = [kind for kind, engine in events if engine == "d0"]
    assert d0[:2] == ["added", "probe"] and d0[-3:] == ["draining", "drained", "removed"], d0
    assert ("readmitted", "d0") in events  # ready again after its unready spell
    # d0's drains met requests still streaming there, and they finished (all are 200).
    met = 0
    for line in lines:
        if line["type"] == "engine" and line["engine"] == "d0" and line["event"] == "draining":
            drained = next(
                later["ts"]
                for later in lines
                if later["type"] == "engine"
                and later["engine"] == "d0"
                and later["event"] == "drained"
                and later["ts"] >= line["ts"]
            )
            met += sum(r["consumer"] == "d0" and line["ts"] <= r["ts"] <= drained for r in requests)
    assert met > 0
    p0 = [kind for kind, engine in events if engine == "p0"]
    assert p0 == ["added", "probe", "readmitted", "draining", "drained", "removed"], p0


async def exercise(
    api: KubeApi,
    process: asyncio.subprocess.Process,
    router: str,
    port: dict[str, int],
    received: dict[str, Any],
) -> int:
    """Every pod change under load; the number of requests sent."""
    client = AsyncOpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    load = Load(client)
    async with aiohttp.ClientSession() as http:

        async def engines() -> dict[str, str]:
            async with http.get(router + "/narwhal/state") as response:
                state = await response.json()
            return {e["id"]: e["state"] for e in state["engines"]}

        async def fleet_is(want: dict[str, str]) -> bool:
            return await engines() == want

        await until(lambda: fleet_is({"p0": "admitted", "d0": "admitted"}), "the first pods")
        async with asyncio.TaskGroup() as clients:
            for index in range(CLIENTS):
                clients.create_task(load.run(index))
            try:
                await load.more(2 * CLIENTS)

                # A new ready pod: judged by readmission, then it takes decodes.
                await api.put(pod("d1", port["d1"], "decode"))
                await until(
                    lambda: fleet_is({"p0": "admitted", "d0": "admitted", "d1": "admitted"}),
                    "d1 added",
                )
                await until(lambda: len(received["d1"]) > 0, "requests on d1")

                # d0 turns unready: drained while its streams finish; then ready again.
                await api.change("d0", lambda body: set_ready(body, False))
                await until(lambda: _state_is(engines, "d0", "drained"), "d0 drained")
                await load.more(CLIENTS)
                await api.change("d0", lambda body: set_ready(body, True))
                await until(lambda: _state_is(engines, "d0", "admitted"), "d0 back")

                # A pod that is not ready yet stays out until it is.
                await api.put(pod("p1", port["p1"], "prefill", ready=False))
                await load.more(CLIENTS)
                assert "p1" not in await engines()
                await api.change("p1", lambda body: set_ready(body, True))
                await until(lambda: _state_is(engines, "p1", "admitted"), "p1 admitted")
                await until(lambda: len(received["p1"]) > 0, "requests on p1")

                # p0 is deleted gracefully: terminating (drained), then gone (removed).
                await api.terminate("p0")
                await until(lambda: _state_is(engines, "p0", "drained"), "p0 drained")
                await api.delete("p0")
                await until(lambda: _state_is(engines, "p0", None), "p0 removed")

                # d0 is deleted outright while serving: drained, then removed once idle.
                await api.delete("d0")
                await until(lambda: _state_is(engines, "d0", None), "d0 removed")
                await load.more(CLIENTS)

                # The API compacts its history under the open watch and then fails a while:
                # the fleet is kept, and a pod added meanwhile arrives by a new list.
                api.end_watches()
                await api.put(pod("d2", port["d2"], "decode"))
                api.compact()
                api.fail_next(500, 503, 500)
                await load.more(CLIENTS)
                await until(lambda: _state_is(engines, "d2", "admitted"), "d2 through a relist")

                # A reload of the file (no `[[engines]]`) leaves discovered engines alone.
                process.send_signal(signal.SIGHUP)
                await load.more(2 * CLIENTS)
                assert await engines() == dict.fromkeys(("d1", "p1", "d2"), "admitted")
            finally:
                load.stop.set()
        assert load.failures == [], load.failures[:5]

        async with http.get(router + "/narwhal/state") as response:
            state = await response.json()
        async with http.get(router + "/metrics") as response:
            metrics = await response.text()
    discovery = state["discovery"]
    assert discovery["synced"] and discovery["lists"]["start"] == 1
    assert discovery["lists"].get("expired", 0) + discovery["lists"].get("failure", 0) >= 1
    assert discovery["changes"] == {
        "add": 5,
        "change": 0,
        "drain": 2,
        "undrain": 1,
        "remove": 2,
    }, discovery
    assert {e["source"] for e in state["engines"]} == {"kubernetes"}
    assert 'narwhal_discovery_changes_total{action="add"} 5.0' in metrics
    assert "narwhal_discovery_last_sync_age_seconds" in metrics
    return load.sent


async def _state_is(read: Any, engine: str, want: str | None) -> bool:
    return bool((await read()).get(engine) == want)


async def test_each_worker_follows_the_pods_with_its_own_watcher(tmp_path: Path) -> None:
    api = KubeApi()
    await api.start()
    try:
        names = NAMES[:3]
        async with SimFleet([replace(FAST, name=name) for name in names]) as sims:
            port = {n: int(sims.engines[i].url.rsplit(":", 1)[1]) for i, n in enumerate(names)}
            for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
                await api.put(pod(name, port[name], role))
            path, journal = tmp_path / "fleet.toml", tmp_path / "j.jsonl"
            fleet_file(path, journal, api.kubeconfig(tmp_path))
            async with serve_workers(tmp_path, path.read_text(), 2, journal) as served:

                async def workers_agree(want: set[str]) -> bool:
                    engines = (await served.state())["engines"]
                    both = {"0": "admitted", "1": "admitted"}
                    return {e["id"] for e in engines} == want and all(
                        e["worker_states"] == both for e in engines
                    )

                await until(lambda: workers_agree({"p0", "p1", "d0"}), "both workers' fleets")
                body = {"model": MODEL, "prompt": "The sea is deep and", "max_tokens": 4}
                results = await asyncio.gather(*(post_fresh(served.url, body) for _ in range(40)))
                assert [status for status, _ in results] == [200] * 40
                await api.delete("p1")
                await until(lambda: workers_agree({"p0", "d0"}), "p1 gone from both workers")
                metrics = await served.metrics()
    finally:
        await api.stop()
    # Summed over the workers: each added three engines and removed one.
    assert 'narwhal_discovery_changes_total{action="add"} 6.0' in metrics
    assert 'narwhal_discovery_changes_total{action="remove"} 2.0' in metrics

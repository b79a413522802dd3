"""Discovery's steps applied to a live fleet through `operations`: the engines it adds are
its own, an operator's drain stands, requests keep their seats, and a reload of the file
never touches discovered engines."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from narwhal.config.discovery import DiscoveryConfig
from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.config.root import Config
from narwhal.fleet.discovery import SOURCE, FleetDiscovery
from narwhal.fleet.lifecycle import Event
from narwhal.fleet.operations import FleetOperations
from narwhal.fleet.table import EngineEvent, Fleet
from support.kube_api import pod, set_ready

STATIC = (EngineSpec("static-p", "http://10.0.0.1:1", Role.PREFILL),)
CONFIG = DiscoveryConfig(enabled=True, namespace="engines", label_selector="app=vllm")


class World:
    """A fleet with one static engine, its operations, discovery (its watcher not run)."""

    def __init__(self, path: Path | None = None) -> None:
        self.fleet = Fleet(STATIC)
        self.events: list[EngineEvent] = []
        self.fleet.listeners.append(self.events.append)
        self.ops = FleetOperations(self.fleet, Config("m", STATIC), path)
        self.discovery = FleetDiscovery(CONFIG, self.fleet, self.ops)
        self.pods: dict[str, dict[str, Any]] = {}

    def show(self, *bodies: dict[str, Any]) -> None:
        self.pods.update({body["metadata"]["name"]: body for body in bodies})
        self.discovery.pods_changed(self.pods)

    def gone(self, name: str) -> None:
        del self.pods[name]
        self.discovery.pods_changed(self.pods)

    def probed(self, engine: str) -> None:
        """Readmission let the new engine in."""
        self.fleet.by_id[engine].lifecycle.apply(Event.READMIT, self.fleet.emit)

    def kinds(self, engine: str) -> list[str]:
        return [e.kind for e in self.events if e.engine == engine]

    def state(self, engine: str) -> str | None:
        found = self.fleet.by_id.get(engine)
        return None if found is None else found.state(asyncio.get_running_loop().time()).value


def unready(body: dict[str, Any]) -> dict[str, Any]:
    set_ready(body, False)
    return body


async def test_ready_pods_join_as_discovered_engines_judged_before_work() -> None:
    world = World()
    world.show(pod("d0", 8200, "decode", ip="10.0.1.1"))
    engine = world.fleet.by_id["d0"]
    assert engine.source == SOURCE and engine.url == "http://10.0.1.1:8200"
    assert world.state("d0") == "ejected"  # until readmission's first probe
    assert world.fleet.by_id["static-p"].source is None
    assert world.kinds("d0") == ["added"]


async def test_an_unready_pod_drains_and_ready_again_undrains() -> None:
    world = World()
    world.show(pod("d0", 8200, "decode", ip="10.0.1.1"))
    world.probed("d0")
    world.show(unready(pod("d0", 8200, "decode", ip="10.0.1.1")))
    assert world.state("d0") == "drained"
    world.show(pod("d0", 8200, "decode", ip="10.0.1.1"))
    assert world.state("d0") == "admitted"
    assert world.kinds("d0") == ["added", "readmitted", "draining", "drained", "readmitted"]


async def test_an_operators_drain_stands_while_the_pod_is_ready() -> None:
    world = World()
    world.show(pod("d0", 8200, "decode", ip="10.0.1.1"))
    world.ops.drain("d0", force=True)
    world.show(unready(pod("d0", 8200, "decode", ip="10.0.1.1")))
    world.show(pod("d0", 8200, "decode", ip="10.0.1.1"))
    assert world.state("d0") == "drained"


async def test_a_deleted_pods_engine_finishes_its_requests_then_goes() -> None:
    world = World()
    world.show(pod("d0", 8200, "decode", ip="10.0.1.1"))
    engine = world.fleet.by_id["d0"]
    world.probed("d0")
    engine.decode_seats = 1  # a request still streaming there
    world.gone("d0")
    assert world.state("d0") == "draining"
    engine.decode_seats = 0
    world.fleet.seat_freed()
    assert world.state("d0") is None
    assert world.kinds("d0")[-3:] == ["draining", "drained", "removed"]


async def test_a_pod_reusing_a_leaving_engines_url_waits_for_it() -> None:
    world = World()
    world.show(pod("d0", 8200, "decode", ip="10.0.1.1"))
    engine = world.fleet.by_id["d0"]
    engine.decode_seats = 1
    world.gone("d0")
    world.show(pod("d1", 8200, "decode", ip="10.0.1.1"))
    assert "d1" not in world.fleet.by_id
    assert world.discovery.waiting == {"d1": "url http://10.0.1.1:8200 is still engine d0's"}
    engine.decode_seats = 0
    world.fleet.seat_freed()
    await asyncio.sleep(0)  # the retry is scheduled, not nested in the event
    assert world.fleet.by_id["d1"].source == SOURCE and world.discovery.waiting == {}


async def test_a_reload_changes_the_files_engines_only(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(
        'model = "m"\n[[engines]]\nid = "static-d"\nurl = "http://10.0.0.2:1"\nrole = "decode"\n'
        '[[engines]]\nid = "static-p"\nurl = "http://10.0.0.1:1"\nrole = "prefill"\n'
    )
    world = World(path)
    world.show(pod("d0", 8200, "decode", ip="10.0.1.1"))
    result = world.ops.reload()
    assert result["added"] == ["static-d"] and result["removing"] == []
    assert world.fleet.by_id["d0"].source == SOURCE and not world.fleet.by_id["d0"].draining


async def test_a_pod_clashing_with_a_static_engine_waits_and_says_why() -> None:
    world = World()
    world.show(pod("static-p", 8200, "decode", ip="10.0.1.1"))
    assert world.fleet.by_id["static-p"].source is None
    summary = world.discovery.summary()
    assert summary["waiting"] == {"static-p": "engine id static-p is a configured engine's"}
    assert summary["pods"]["static-p"] == {"ready": True, "engine": True, "reason": "ready"}

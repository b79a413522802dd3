"""The process assembled: every loop runs in its one background group, and stop ends all."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from narwhal.app.process import Hooks, Router
from narwhal.config.root import load_config, parse_config
from narwhal.protocol.bodies import Endpoint

CONFIG = {
    "model": "m",
    "engine": {"metrics_interval_s": 5},
    "engines": [
        {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
        {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode"},
    ],
}


async def test_every_loop_runs_in_the_background_and_stop_ends_them_all() -> None:
    before = asyncio.all_tasks()
    router = Router(parse_config(CONFIG))
    await router.start()
    started = {task.get_name() for task in asyncio.all_tasks() - before}
    assert {"background", "readmission", "engine-reports", "served-models", "loop-lag"} <= started
    assert router.background.running == 4
    await router.stop()
    assert asyncio.all_tasks() - before == set()


class BadBody:
    """A client whose body is not JSON: the request ends in a 400 before any engine leg."""

    committed = False

    def __init__(self) -> None:
        self.answers: list[int] = []

    def header(self, name: str) -> str | None:
        return None

    async def body(self, timeout_s: float) -> bytes:
        return b"{not json"

    async def answer(
        self, status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
    ) -> None:
        self.answers.append(status)


async def test_a_callers_hooks_hear_each_request_once_after_the_routers_own() -> None:
    arrived: list[str] = []
    ended: list[tuple[str, int, int]] = []

    def seen(now: float) -> int:
        requests: int = router.recent.summary(now)["requests"]
        return requests

    router = Router(
        parse_config(CONFIG),
        hooks=Hooks(
            arrival=[lambda call: arrived.append(call.request_id)],
            # The router's own hooks (its recent calls among them) have run by now.
            ended=[lambda call, now: ended.append((call.request_id, call.status, seen(now)))],
        ),
    )
    await router.start()
    try:
        reply = BadBody()
        await router.handle(reply, Endpoint.COMPLETIONS)  # type: ignore[arg-type]
    finally:
        await router.stop()
    assert reply.answers == [400]
    assert len(arrived) == 1 and ended == [(arrived[0], 400, 1)]
    assert router.in_flight == 0


def test_a_reload_applies_tenants_limits_to_the_running_admission(tmp_path: Path) -> None:
    def write(rpm: int) -> None:
        tenants = '[[tenants]]\nname = "batch"\napi_keys = ["k"]\n'
        path.write_text(
            'model = "m"\n[[engines]]\nid = "p0"\nurl = "http://127.0.0.1:9"\nrole = "both"\n'
            + tenants
            + f"requests_per_minute = {rpm}\n"
        )

    path = tmp_path / "fleet.toml"
    write(60)
    router = Router(load_config(path), config_path=path)
    assert router.admission is not None
    write(5)
    result = router.operations.reload()
    assert result["restart_required"] == []
    assert router.admission.tenants["batch"].requests_per_minute == 5
    assert router.admission.limits.headers("batch", 0.0)["x-ratelimit-limit-requests"] == "5"


def test_without_tenants_there_is_no_admission() -> None:
    assert Router(parse_config(CONFIG)).admission is None

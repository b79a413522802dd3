"""Two router replicas in front of one fleet (`server.replicas = 2`): together they never
send an engine more than its seat limits, as the engine itself counts its requests."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.tools.sim.fleet import SimFleet
from support.stack import COMPLETION, FAST, peak_loads
from support.workers import post_fresh

ROLES = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))


async def test_two_replicas_keep_every_engine_within_its_seat_limits(tmp_path: Path) -> None:
    options = [
        replace(FAST, name=name, inter_token_s=0.01, request_overhead_s=0.03) for name, _ in ROLES
    ]
    async with SimFleet(options) as fleet:
        config = parse_config(
            {
                "model": COMPLETION["model"],
                "server": {"replicas": 2},
                "engines": [
                    {
                        "id": name,
                        "url": engine.url,
                        "role": role,
                        "max_prefill_seats": 4,
                        "max_decode_seats": 5,
                    }
                    for (name, role), engine in zip(ROLES, fleet.engines, strict=True)
                ],
            },
            "test",
        )
        routers = [RouterServer(config, port=0), RouterServer(config, port=0)]
        for router in routers:
            await router.start()
        try:
            state = routers[0].router.state()
            d0 = next(e for e in state["engines"] if e["id"] == "d0")
            # Each replica takes floor(5 / 2) decode seats: 4 of the 5 in all.
            assert d0["seats"]["decode"] == {"in_use": 0, "limit": 5, "share": 2}
            body: dict[str, Any] = {**COMPLETION, "max_tokens": 20, "stream": True}
            async with peak_loads(fleet.engines) as peak:
                results = await asyncio.gather(
                    *(post_fresh(routers[i % 2].url, body) for i in range(60))
                )
            assert all(status == 200 and b"[DONE]" in answer for status, answer in results)
            prefill, *decode = fleet.engines
            assert peak[prefill] <= 4 and all(peak[e] <= 4 for e in decode), peak
            assert max(peak[e] for e in decode) == 4, peak
        finally:
            for router in routers:
                await router.stop()

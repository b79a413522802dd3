"""The role controller under deep overload, against a pinned split, over simulated engines.

    .venv/bin/python benchmarks/controller_overload.py [--speed 1] [--json PATH]

Four simulated engines (a `dev` profile with slow prompts and costly decode batches, the
KV lease vLLM's 30 s) replay one trace twice, through a router with the role controller
on (its default timing, every engine `both`, starting 1P+3D) and through a static 1P+3D
router. The trace has three phases:

| phase       | load                                                                  |
|-------------|-----------------------------------------------------------------------|
| `warm-up`   | light chat load, longer than the controller's dwell time              |
| `saturated` | long prompts, `--prefill-worth` (2.7) producers' worth for            |
|             |   `--saturated-s` (300 s): one producer's queue passes the KV lease,  |
|             |   handoffs expire, hardly a first token                               |
| `decode`    | short prompts, long answers: a single consumer's batch is too slow    |

It prints, in trace seconds: the controller's moves; the first move after the saturated
phase began; goodput (requests meeting both objectives, per second of arrivals) in the
saturated phase's last third, controller and pinned; the first move back toward decode
after the decode phase began; and each run's wall time and CPU seconds (engines, and
router + client).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.tools.goodput.replay import FleetProcess, replay, router_config
from narwhal.tools.goodput.score import Outcome, Slo
from narwhal.tools.goodput.traces import Mix, TraceRequest

ENGINES = 4
PREFILL_S_PER_TOKEN = 0.0002  # a 3000-token prompt: 0.6 s of one engine
SIM: dict[str, Any] = {
    "profile": "dev",
    "request_overhead_s": 0.002,
    "prefill_s_per_token": PREFILL_S_PER_TOKEN,
    "inter_token_s": 0.02,
    "slowdown_per_seq": 0.04,  # a batch of 26 steps twice as slowly as one sequence
    "kv_pull_s_per_block": 0.0,
    "kv_lease_s": 30.0,
}
# The goodput tool's factors: five lone prompts' time, three lone decode steps.
SLO = Slo(ttft_s=5 * 0.6, tpot_s=3 * 0.02)
WARM_UP = ("warm-up", Mix(prompt=(500, 1000), output=(30, 60)), 2.0, 70.0)
SATURATED = Mix(prompt=(2000, 4000), output=(16, 32))
DECODE = ("decode", Mix(prompt=(150, 250), output=(80, 120)), 10.0, 150.0)
SATURATED_S = 300.0


def build_trace(seed: int, prefill_worth: float, saturated_s: float) -> list[TraceRequest]:
    """Poisson arrivals, phase after phase."""
    engine_s = SATURATED.mean_prompt * PREFILL_S_PER_TOKEN
    saturated = ("saturated", SATURATED, prefill_worth / engine_s, saturated_s)
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    start = 0.0
    for name, mix, rate, length in (WARM_UP, saturated, DECODE):
        t = start + rng.expovariate(rate)
        while t < start + length:
            prompt, output = mix.draw(rng, 1.0)
            requests.append(TraceRequest(round(t, 6), prompt, output, name))
            t += rng.expovariate(rate)
        start += length
    return requests


def config_of(urls: list[str], speed: float, controller: bool) -> dict[str, Any]:
    """The goodput tool's router (patient timeouts, unlimited seats), with vLLM's KV lease
    and, for the controller run, the controller at its default timing (scaled by speed)."""
    sections = None
    if controller:
        sections = {
            "controller": {
                "enabled": True,
                "interval_s": 5.0 / speed,
                "window_s": 30.0 / speed,
                "dwell_s": 60.0 / speed,
                "cooldown_s": 30.0 / speed,
            },
            "slo": {"ttft_s": SLO.ttft_s / speed, "tpot_s": SLO.tpot_s / speed},
        }
    raw = router_config(urls, 1, sections)
    raw["engine"]["kv_lease_s"] = SIM["kv_lease_s"]
    return raw


async def run(
    fleet: FleetProcess, trace: list[TraceRequest], speed: float, controller: bool
) -> dict[str, Any]:
    start = await fleet.fair_start()
    server = RouterServer(parse_config(config_of(fleet.urls, speed, controller), source="bench"))
    await server.start()
    engine_cpu, own_cpu = await fleet.cpu_seconds(), time.process_time()
    began, wall = time.time(), time.monotonic()
    summary = None
    try:
        outcomes = await replay(server.url, trace, speed, salt=f"overload-{controller}")
        if server.router.controller is not None:
            summary = server.router.controller.summary()
    finally:
        await server.shutdown(1.0)
    moves = [
        {
            "at_s": round((move["ts"] - began) * speed, 1),
            "engine": move["engine"],
            "to": move["to"],
            "reason": move["reason"],
        }
        for move in (summary or {}).get("timeline", [])
    ]
    return {
        "controller": controller,
        "outcomes": outcomes,
        "moves": moves,
        "split": (summary or {}).get("split"),
        "wall_s": round(time.monotonic() - wall, 1),
        "engine_cpu_s": round(await fleet.cpu_seconds() - engine_cpu, 1),
        "router_client_cpu_s": round(time.process_time() - own_cpu, 1),
        "start": start,
    }


def goodput(outcomes: list[Outcome], since: float, until: float) -> float:
    good = sum(o.good(SLO) for o in outcomes if since <= o.arrival_s < until)
    return round(good / (until - since), 3)


def ttft_p50(outcomes: list[Outcome], since: float, until: float) -> float | None:
    """The median TTFT of the requests that arrived in the span and completed."""
    values = sorted(
        o.ttft_s
        for o in outcomes
        if o.completed and o.ttft_s is not None and since <= o.arrival_s < until
    )
    return round(values[len(values) // 2], 2) if values else None


def failed(outcomes: list[Outcome], phase: str) -> int:
    return sum(not o.completed for o in outcomes if o.phase == phase)


async def main(args: argparse.Namespace) -> int:
    trace = build_trace(args.seed, args.prefill_worth, args.saturated_s)
    saturated_at = WARM_UP[3]
    decode_at = saturated_at + args.saturated_s
    last_third = (saturated_at + 2 * args.saturated_s / 3, decode_at)
    fields = {**SIM, "speed": args.speed}
    results = []
    async with FleetProcess(ENGINES, fields) as fleet:
        for controller in (True, False):
            result = await run(fleet, trace, args.speed, controller)
            results.append(result)
            print(
                f"{'controller' if controller else 'pinned 1P3D'}: {result['wall_s']} s wall, "
                f"engines {result['engine_cpu_s']} s CPU, router+client "
                f"{result['router_client_cpu_s']} s CPU",
                file=sys.stderr,
                flush=True,
            )
    active, pinned = results
    moves = active["moves"]
    first = next((m for m in moves if m["at_s"] >= saturated_at and m["to"] == "prefill"), None)
    back = next((m for m in moves if m["at_s"] >= decode_at and m["to"] == "decode"), None)
    report = {
        "trace": {
            "requests": len(trace),
            "seed": args.seed,
            "prefill_worth": args.prefill_worth,
            "saturated_s": args.saturated_s,
            "phases_s": {"warm-up": 0.0, "saturated": saturated_at, "decode": decode_at},
            "speed": args.speed,
        },
        "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s},
        "moves": moves,
        "final_split": active["split"],
        "first_move_after_saturation_s": None
        if first is None
        else round(first["at_s"] - saturated_at, 1),
        "last_third_goodput": {
            "span_s": last_third,
            "controller": goodput(active["outcomes"], *last_third),
            "pinned_1p3d": goodput(pinned["outcomes"], *last_third),
            "ttft_p50_s": {
                "controller": ttft_p50(active["outcomes"], *last_third),
                "pinned_1p3d": ttft_p50(pinned["outcomes"], *last_third),
            },
        },
        "saturated_failures": {
            "controller": failed(active["outcomes"], "saturated"),
            "pinned_1p3d": failed(pinned["outcomes"], "saturated"),
        },
        "first_move_back_after_decode_s": None
        if back is None
        else round(back["at_s"] - decode_at, 1),
        "decode_goodput": {
            "controller": goodput(active["outcomes"], decode_at, decode_at + DECODE[3]),
            "pinned_1p3d": goodput(pinned["outcomes"], decode_at, decode_at + DECODE[3]),
        },
        "runs": [
            {key: r[key] for key in ("controller", "wall_s", "engine_cpu_s", "router_client_cpu_s")}
            for r in results
        ],
    }
    text = orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed", type=float, default=1.0, help="replay this much faster")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prefill-worth", type=float, default=2.7, help="saturated phase, in producers"
    )
    parser.add_argument(
        "--saturated-s", type=float, default=SATURATED_S, help="the saturated phase's length"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    sys.exit(asyncio.run(main(parser.parse_args())))

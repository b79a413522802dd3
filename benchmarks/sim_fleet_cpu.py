"""What a simulated fleet costs in CPU at a profile's realistic timings.

Eight engines run in one child process (one event loop); this process keeps 64 streams
open against them, round robin, each asking for a prompt and a few hundred tokens, and
reports the engines' CPU seconds against wall seconds. Steps are computed, not busy-waited:
the engines' CPU should follow the tokens they write, not the timers they keep.

    .venv/bin/python benchmarks/sim_fleet_cpu.py [--engines 8] [--streams 64] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import aiohttp

from narwhal.runtime import main as runtime
from narwhal.tools.goodput.replay import FleetProcess
from narwhal.tools.sim.model import VOCAB_SIZE


async def _stream(session: aiohttp.ClientSession, url: str, prompt: int, output: int) -> int:
    body = {
        "prompt": [random.randrange(VOCAB_SIZE) for _ in range(prompt)],
        "max_tokens": output,
        "stream": True,
    }
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        async for data in response.content.iter_any():
            tokens += data.count(b"data: {")
    return tokens


async def main(args: argparse.Namespace) -> None:
    fields = {"profile": args.profile, "speed": 1.0}
    async with FleetProcess(args.engines, fields) as fleet:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            deadline = time.monotonic() + args.seconds
            totals = [0] * args.streams

            async def client(index: int) -> None:
                while time.monotonic() < deadline:
                    url = fleet.urls[(index + totals[index]) % len(fleet.urls)]
                    totals[index] += await _stream(session, url, args.prompt, args.output)

            cpu_before = await fleet.cpu_seconds()
            client_before = time.process_time()
            started = time.monotonic()
            await asyncio.gather(*(client(i) for i in range(args.streams)))
            wall = time.monotonic() - started
            engine_cpu = await fleet.cpu_seconds() - cpu_before
            client_cpu = time.process_time() - client_before
    tokens = sum(totals)
    print(
        f"{args.engines} engines ({args.profile}), {args.streams} streams, {wall:.1f} s wall: "
        f"{tokens} tokens ({tokens / wall:.0f}/s, {tokens / wall / args.streams:.1f}/s a "
        f"stream); engine CPU {engine_cpu:.1f} s = {engine_cpu / wall:.2f} of a core, "
        f"client CPU {client_cpu:.1f} s = {client_cpu / wall:.2f} of a core"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--output", type=int, default=256)
    runtime.run(main(parser.parse_args()))

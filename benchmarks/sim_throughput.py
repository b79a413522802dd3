"""How many tokens per second one simulated engine relays across concurrent streams.

The engine runs in this process with no inter-token interval and no prefill cost; the load
comes from a separate process so the client's parsing does not share the engine's core.
Later benchmarks measure the router against this engine, so it has to be much faster
than the router: the target is 20,000 tokens/s in total across 64 streams.

    .venv/bin/python benchmarks/sim_throughput.py [--streams 64] [--tokens 512] [--rounds 10]

Exits non-zero when the total falls short of the target.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import aiohttp
import orjson
import uvloop

from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.options import SimOptions

TARGET_TOKENS_PER_S = 20_000

PROMPT = "Count the narwhals in the fjord and tell me a long story about each of them."


@dataclass(frozen=True, slots=True)
class RoundResult:
    tokens: int
    seconds: float


async def _stream(session: aiohttp.ClientSession, url: str, tokens: int) -> int:
    """One streaming completion; returns the tokens received, checking the stream's end."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "stream": True}
    received = 0
    finished = False
    buffer = b""
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for data in response.content.iter_any():
            events = (buffer + data).split(b"\n\n")
            buffer = events.pop()
            for event in events:
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    finished = True
                    continue
                choice = orjson.loads(payload)["choices"][0]
                received += bool(choice["text"])
    if not finished or received != tokens:
        raise RuntimeError(f"stream ended badly: {received}/{tokens} tokens, done={finished}")
    return received


async def _load(url: str, streams: int, tokens: int, rounds: int) -> list[RoundResult]:
    results = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _stream(session, url, tokens)  # warm-up: connections, caches
        for _ in range(rounds):
            started = time.perf_counter()
            counts = await asyncio.gather(*(_stream(session, url, tokens) for _ in range(streams)))
            results.append(RoundResult(sum(counts), time.perf_counter() - started))
    return results


def _load_process(url: str, streams: int, tokens: int, rounds: int, pipe: Connection) -> None:
    pipe.send(uvloop.run(_load(url, streams, tokens, rounds)))


async def _bench(streams: int, tokens: int, rounds: int) -> float:
    """Run the load against a fresh engine; returns total tokens/s."""
    options = SimOptions(
        inter_token_s=0.0,
        prefill_s_per_token=0.0,
        request_overhead_s=0.0,
        slowdown_per_seq=0.0,
        max_model_len=tokens + 1024,
    )
    engine = SimEngine(options)
    await engine.start()
    receiver, sender = multiprocessing.get_context("spawn").Pipe(duplex=False)
    load = multiprocessing.get_context("spawn").Process(
        target=_load_process, args=(engine.url, streams, tokens, rounds, sender)
    )
    try:
        load.start()
        cpu_before = os.times()
        results: list[RoundResult] = await asyncio.to_thread(receiver.recv)
        cpu_after = os.times()
        await asyncio.to_thread(load.join)
    finally:
        await engine.stop()
    engine_cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    total_tokens = sum(result.tokens for result in results)
    total_seconds = sum(result.seconds for result in results)
    for index, result in enumerate(results, 1):
        print(
            f"round {index}: {result.tokens} tokens in {result.seconds:.3f} s "
            f"= {result.tokens / result.seconds:,.0f} tokens/s"
        )
    print(
        f"total: {streams} concurrent streams x {tokens} tokens x {rounds} rounds: "
        f"{total_tokens / total_seconds:,.0f} tokens/s relayed; engine process CPU "
        f"{engine_cpu:.2f} s ({total_tokens / engine_cpu:,.0f} tokens per CPU second)"
    )
    return total_tokens / total_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    tokens_per_s = uvloop.run(_bench(args.streams, args.tokens, args.rounds))
    met = tokens_per_s >= TARGET_TOKENS_PER_S
    print(f"target {TARGET_TOKENS_PER_S:,} tokens/s: {'met' if met else 'NOT met'}")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()

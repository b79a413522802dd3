"""What `previous_response_id` adds: reading a stored response's conversation back.

    .venv/bin/python benchmarks/responses_store.py [--responses 100000] [--reads 10000]
        [--stores sqlite,redis] [--redis-url redis://host:6379/0] [--path FILE]

Fills each store with `--responses` stored responses (conversations of 1 to 10 turns, each
turn's input and response a few hundred bytes, four tenants), then reads the conversation of
one random stored id at a time, `--reads` times, as the router does for a request naming a
previous response, and prints p50/p99/max in milliseconds: wall time, and this thread's CPU
time (the store's own cost; on a loaded machine the wall time also holds the time the
process waited for a core). It also times the last puts of the fill, one at a time.

Redis is the server at `--redis-url`, or else a redis-server of this machine started on a
free port for the run (none installed: Redis is left out). The target: under 1 ms p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis.asyncio as aioredis
from bench_procs import free_port

from narwhal.conversations.record import ConversationStore, StoredResponse
from narwhal.conversations.redis import RedisStore
from narwhal.conversations.sqlite import SqliteStore
from narwhal.runtime import main as runtime
from narwhal.tools.goodput.score import percentile

TARGET_P99_MS = 1.0
MAX_AGE_S = 30 * 86400.0
TENANTS = ("acme", "globex", "initech", "umbrella")
WORDS = ("the", "of", "a", "model", "router", "engine", "token", "cache", "prefill", "decode")
# The last puts of the fill are timed one at a time; the rest go this many at once.
TIMED_PUTS = 5000
FILL_AT_ONCE = 32


def text(rng: random.Random, size: int) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def conversations(count: int, seed: int) -> Iterator[StoredResponse]:
    """`count` stored responses, a conversation's turns in order, conversations of 1-10."""
    rng = random.Random(seed)
    start = time.time() - 3600.0
    made = 0
    while made < count:
        tenant = rng.choice(TENANTS)
        earlier: StoredResponse | None = None
        for _ in range(min(rng.randint(1, 10), count - made)):
            response_id = f"resp_{rng.getrandbits(96):024x}"
            question = [{"role": "user", "content": text(rng, rng.randint(150, 450))}]
            answer = {
                "id": response_id,
                "object": "response",
                "model": "narwhal-sim",
                "output": [{"type": "message", "content": text(rng, rng.randint(200, 600))}],
                "usage": {"input_tokens": rng.randint(50, 2000), "output_tokens": 120},
            }
            record = StoredResponse(
                id=response_id,
                tenant=tenant,
                model="narwhal-sim",
                created_at=start + made * 0.01,
                previous_id=earlier.id if earlier else None,
                ancestors=(*earlier.ancestors, earlier.id) if earlier else (),
                input=orjson.dumps(question),
                response=orjson.dumps(answer),
            )
            yield record
            earlier = record
            made += 1


@dataclass(frozen=True)
class Figures:
    store: str
    fill_s: float
    put_ms: list[float]
    read_ms: list[float]
    read_cpu_ms: list[float]
    turns: float


def spread(values: Sequence[float]) -> str:
    p50, p99 = percentile(values, 50) or 0.0, percentile(values, 99) or 0.0
    return f"p50 {p50:.3f}  p99 {p99:.3f}  max {max(values):.3f} ms"


async def measure(
    name: str, store: ConversationStore, responses: int, reads: int, seed: int
) -> Figures:
    records = list(conversations(responses, seed))
    # The records are the benchmark's, not the router's: out of every collection's scan.
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    bulk = records[: max(0, len(records) - TIMED_PUTS)]
    for index in range(0, len(bulk), FILL_AT_ONCE):
        await asyncio.gather(*(store.put(r) for r in bulk[index : index + FILL_AT_ONCE]))
    put_ms = []
    for record in records[len(bulk) :]:
        before = time.perf_counter()
        await store.put(record)
        put_ms.append((time.perf_counter() - before) * 1000)
    fill_s = time.perf_counter() - started
    rng = random.Random(seed + 1)
    read_ms, read_cpu_ms, turns = [], [], 0
    for _ in range(reads):
        record = rng.choice(records)
        before, before_cpu = time.perf_counter(), time.thread_time()
        chain = await store.conversation(record.id, record.tenant)
        read_cpu_ms.append((time.thread_time() - before_cpu) * 1000)
        read_ms.append((time.perf_counter() - before) * 1000)
        assert chain[-1] == record and len(chain) == len(record.ancestors) + 1
        turns += len(chain)
    return Figures(name, fill_s, put_ms, read_ms, read_cpu_ms, turns / max(reads, 1))


@contextlib.contextmanager
def local_redis(directory: Path) -> Iterator[str | None]:
    """A redis-server of this machine on a free port, without persistence; None if there is
    no redis-server."""
    executable = shutil.which("redis-server")
    if executable is None:
        yield None
        return
    port = free_port()
    argv = [
        *(executable, "--port", str(port), "--bind", "127.0.0.1"),
        *("--save", "", "--appendonly", "no", "--dir", str(directory)),
    ]
    server = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30.0
        while server.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"redis-server on port {port} did not answer")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=30)


async def run(
    stores: Sequence[str],
    responses: int,
    reads: int,
    seed: int,
    path: Path,
    redis_url: str | None,
    say: Callable[[str], None],
) -> list[Figures]:
    figures = []
    prefix = f"narwhal-bench-{os.getpid()}:"
    for name in stores:
        opening: Awaitable[ConversationStore]
        if name == "sqlite":
            for stale in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                stale.unlink(missing_ok=True)

            async def sqlite() -> ConversationStore:
                return SqliteStore(path, max_stored=responses, max_age_s=MAX_AGE_S)

            opening = sqlite()
        elif redis_url is None:
            say("redis: no --redis-url and no redis-server here: left out")
            continue
        else:
            # A prefix of the run's own, so that a shared server's other keys are left alone.
            opening = RedisStore.connect(
                redis_url, max_stored=responses, max_age_s=MAX_AGE_S, prefix=prefix
            )
        store = await opening
        say(f"{name}: filling with {responses:,} responses")
        try:
            figures.append(await measure(name, store, responses, reads, seed))
        finally:
            await store.close()
            if name == "redis" and redis_url is not None:
                await forget(redis_url, prefix)
    return figures


async def forget(url: str, prefix: str) -> None:
    """Delete the run's keys from the server."""
    client = aioredis.Redis.from_url(url)
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) == 1000:
                await client.delete(*batch)
                batch.clear()
        if batch:
            await client.delete(*batch)
    finally:
        await client.aclose()


def report(figures: Sequence[Figures], reads: int) -> list[str]:
    lines = []
    for f in figures:
        p99 = percentile(f.read_ms, 99) or 0.0
        verdict = "met" if p99 < TARGET_P99_MS else "NOT met"
        lines += [
            f"{f.store}: filled in {f.fill_s:.1f} s",
            f"  put, one at a time ({len(f.put_ms):,}):  {spread(f.put_ms)}",
            f"  conversation ({reads:,} reads, {f.turns:.1f} turns on average):",
            f"    wall  {spread(f.read_ms)}",
            f"    CPU   {spread(f.read_cpu_ms)}",
            f"  target p99 under {TARGET_P99_MS:.0f} ms (wall): {verdict}",
        ]
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    lines.append(f"load average {load} on {os.cpu_count()} cores")
    return lines


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--responses", type=int, default=100_000)
    parser.add_argument("--reads", type=int, default=10_000)
    parser.add_argument("--stores", default="sqlite,redis")
    parser.add_argument("--redis-url", help="a Redis server to use (default: start one)")
    parser.add_argument("--path", type=Path, help="the SQLite file (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s]
    if any(s not in ("sqlite", "redis") for s in stores):
        parser.error("stores: sqlite, redis")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="narwhal-responses-") as scratch:
        directory = Path(scratch)
        path = args.path or directory / "responses.sqlite3"
        with contextlib.ExitStack() as stack:
            url = args.redis_url
            if url is None and "redis" in stores:
                url = stack.enter_context(local_redis(directory))
            figures = runtime.run(
                run(stores, args.responses, args.reads, args.seed, path, url, say), server=True
            )
    for line in report(figures, args.reads):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

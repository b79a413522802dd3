"""`narwhal bench --placement`: placement policies on traces that repeat themselves, in one run.

    narwhal bench --placement [--traces multi-turn,shared,no-reuse] [--seed 1] [--json PATH]

For each trace (see `placement_traces`) and each policy, a fresh simulated fleet (4 prefill
and 2 decode engines, empty caches) and a fresh router in this process replay the same
sessions; per policy it reports what the producers' `/metrics` count (prefill tokens
computed, `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`), the cached tokens the
clients' usage reports (`prompt_tokens_details.cached_tokens`), TTFT p50/p99 as clients
see it, goodput (requests meeting both SLOs, per second) and load imbalance (most requests
on one producer over the mean).

| policy    | what it is                                                                  |
|-----------|-----------------------------------------------------------------------------|
| `p2c`     | `[placement] policy = "p2c"`: power of two choices on load                 |
| `session` | `policy = "session"`: a consistent hash of the request's `user`           |
| `prefix`  | `policy = "prefix"`: the router's own prefix index within the load bound  |
| `oracle`  | `prefix`, but each engine's exact cache instead of the index (it reads the |
|           |   simulated engines' caches, which no router can)                          |
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson
from placement_traces import TRACES, Session, build, request_count

from narwhal.app.server import RouterServer
from narwhal.config.placement import PlacementConfig
from narwhal.config.root import parse_config
from narwhal.fleet.placement import Placer, PromptKey
from narwhal.router.call import Call
from narwhal.runtime import main as runtime
from narwhal.tools.goodput.score import percentile
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.fleet import SimFleet
from narwhal.tools.sim.model import chat_prompt, tokenize
from narwhal.tools.sim.options import profile_options

MODEL = "narwhal-sim"
POLICIES = ("p2c", "session", "prefix", "oracle")
PRODUCERS, CONSUMERS = 4, 2
MAX_TOKENS = 8
# An engine: 5,000 prompt tokens a second; a KV cache of 1,536 blocks of 16 tokens, about
# 8 long conversations' worth, so a policy that scatters conversations evicts.
ENGINE = {
    "prefill_s_per_token": 2e-4,
    "inter_token_s": 0.01,
    "num_kv_blocks": 1536,
    "kv_lease_s": 600.0,
    "enable_prompt_tokens_details": True,
}
SLO_TTFT_S = 0.5
SLO_TPOT_S = 0.05


@dataclass(slots=True)
class Figures:
    trace: str
    policy: str
    requests: int
    completed: int
    prefill_tokens: int
    cache_queries: int
    cache_hits: int
    usage_cached_tokens: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    goodput_rps: float
    imbalance: float
    wall_s: float
    errors: list[str]

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.cache_queries if self.cache_queries else 0.0


@dataclass(slots=True)
class _Result:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    cached: int = 0


def install_oracle(placer: Placer, engines: Mapping[str, SimEngine]) -> None:
    """Placement by each engine's exact cache: the tokens of the prompt it holds."""
    last: list[tuple[PromptKey, list[int]]] = []

    def match(engine: str, key: PromptKey) -> int:
        if not last or last[0][0] is not key:
            messages = key.body.get("messages")
            assert isinstance(messages, list)
            last[:] = [(key, tokenize(chat_prompt(messages)))]
        sim = engines[engine]
        return sim.cached_prefix_tokens(last[0][1]) // sim.options.kv_block_size

    placer.match = match
    placer.min_match = 1


def router_config(urls: Sequence[str], policy: str, placement: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "server": {"host": "127.0.0.1", "port": 0},
        "engine": {"kv_lease_s": 600.0, "decode_read_timeout_s": 0.0},
        "serving": {"request_timeout_s": 300.0, "queue_capacity": 100_000},
        "recovery": {"eject_after": 1_000_000},
        "placement": {**placement, "policy": "prefix" if policy == "oracle" else policy},
        "engines": [
            {
                "id": f"e{i}",
                "url": url,
                "role": "prefill" if i < PRODUCERS else "decode",
                "max_prefill_seats": 0,
                "max_decode_seats": 0,
            }
            for i, url in enumerate(urls)
        ],
    }


async def run_policy(
    trace: str,
    sessions: Sequence[Session],
    policy: str,
    seed: int,
    placement: Mapping[str, Any],
) -> Figures:
    options = [
        profile_options("dev", **ENGINE, model=MODEL, name=f"engine-{i}", port=0)
        for i in range(PRODUCERS + CONSUMERS)
    ]
    async with SimFleet(options) as fleet:
        urls = [engine.url for engine in fleet]
        raw = router_config(urls, policy, placement)
        server = RouterServer(parse_config(raw, source="placement bench"))
        # Every policy's load-based draws come from the same sequence.
        server.router.fleet.placer.rng.seed(seed)
        if policy == "oracle":
            by_id = {f"e{i}": engine for i, engine in enumerate(fleet)}
            install_oracle(server.router.fleet.placer, by_id)
        producers: Counter[str] = Counter()

        def count(call: Call, now: float) -> None:
            if call.producer is not None and call.status == 200:
                producers[call.producer] += 1

        server.router.requests.call_hooks.append(count)
        await server.start()
        try:
            started = time.monotonic()
            results = await replay(server.url, sessions)
            wall = time.monotonic() - started
            text = await _scrape([engine.url for engine in fleet][:PRODUCERS])
        finally:
            await server.shutdown(1.0)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    good = [
        r
        for r in ok
        if r.ttft_s is not None
        and r.ttft_s <= SLO_TTFT_S
        and (r.tpot_s is None or r.tpot_s <= SLO_TPOT_S)
    ]
    loads = [producers[f"e{i}"] for i in range(PRODUCERS)]
    mean = sum(loads) / len(loads)
    return Figures(
        trace=trace,
        policy=policy,
        requests=len(results),
        completed=len(ok),
        prefill_tokens=round(
            _total(text, "vllm:prompt_tokens_by_source", 'source="local_compute"')
        ),
        cache_queries=round(_total(text, "vllm:prefix_cache_queries")),
        cache_hits=round(_total(text, "vllm:prefix_cache_hits")),
        usage_cached_tokens=sum(r.cached for r in ok),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        goodput_rps=len(good) / wall if wall else 0.0,
        imbalance=max(loads) / mean if mean else 0.0,
        wall_s=wall,
        errors=[r.error for r in results if r.error is not None],
    )


async def _scrape(urls: Sequence[str]) -> list[str]:
    async with aiohttp.ClientSession() as session:
        texts = []
        for url in urls:
            async with session.get(url + "/metrics") as response:
                texts.append(await response.text())
        return texts


def _total(texts: Sequence[str], name: str, label: str = "") -> float:
    """A counter summed over engines (`label`: only series carrying it)."""
    pattern = re.compile(rf"^{re.escape(name)}_total\{{([^}}]*)\}} (\S+)$", re.M)
    return sum(
        float(value) for text in texts for labels, value in pattern.findall(text) if label in labels
    )


async def replay(url: str, sessions: Sequence[Session]) -> list[_Result]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def converse(session: Session) -> list[_Result]:
            await asyncio.sleep(max(0.0, start + session.start_s - loop.time()))
            results = []
            for turn in session.turns:
                await asyncio.sleep(turn.think_s)
                results.append(await _chat(client, url, session.user, turn.messages))
            return results

        nested = await asyncio.gather(*(converse(s) for s in sessions))
    return [result for results in nested for result in results]


async def _chat(
    client: aiohttp.ClientSession,
    url: str,
    user: str,
    messages: Sequence[tuple[str, str]],
) -> _Result:
    body = {
        "model": MODEL,
        "messages": [{"role": role, "content": content} for role, content in messages],
        "max_tokens": MAX_TOKENS,
        "user": user,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    first: float | None = None
    last, tokens, cached = sent, 0, 0
    async with client.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return _Result(False, f"{response.status}: {(await response.read())[:200]!r}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                return _Result(False, str(event["error"])[:200])
            if event.get("usage"):
                details = event["usage"].get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens") or 0
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                last = time.monotonic()
                first = first if first is not None else last
                tokens += 1
    if first is None:
        return _Result(False, "no token")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return _Result(True, None, first - sent, tpot, cached)


def chunking_cost(sessions: Sequence[Session], rounds: int = 5) -> str:
    """What the router's prefix keys cost per request on this trace: CPU per `key()`."""
    placer = Placer(PlacementConfig(), random.Random(0))
    bodies = [
        {"messages": [{"role": r, "content": c} for r, c in turn.messages]}
        for session in sessions
        for turn in session.turns
    ]
    chars = sum(len(str(body["messages"])) for body in bodies) / len(bodies)
    started = time.process_time()
    for _ in range(rounds):
        for body in bodies:
            placer.key(body)
    per_request = (time.process_time() - started) / (rounds * len(bodies))
    return (
        f"  prefix keys: {per_request * 1e6:.0f} us CPU per request (prompts ~{chars:,.0f} chars)"
    )


def table(figures: Sequence[Figures]) -> str:
    head = (
        f"{'trace':<11}{'policy':<9}{'done':>9}{'prefill tok':>13}{'hit rate':>10}"
        f"{'usage cached':>14}{'TTFT p50':>10}{'p99':>8}{'goodput':>9}{'max/mean':>10}"
    )
    rows = [head]
    for f in figures:
        rows.append(
            f"{f.trace:<11}{f.policy:<9}{f'{f.completed}/{f.requests}':>9}"
            f"{f.prefill_tokens:>13,}{f.hit_rate:>10.3f}{f.usage_cached_tokens:>14,}"
            f"{_ms(f.ttft_p50_s):>10}{_ms(f.ttft_p99_s):>8}{f.goodput_rps:>9.2f}"
            f"{f.imbalance:>10.2f}"
        )
    return "\n".join(rows)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def verdicts(figures: Sequence[Figures]) -> list[str]:
    """The issue's bars, each with its measured value."""
    by = {(f.trace, f.policy): f for f in figures}
    lines = []
    ours, oracle, p2c = (by.get(("multi-turn", p)) for p in ("prefix", "oracle", "p2c"))
    if ours and oracle and p2c:
        share = ours.hit_rate / oracle.hit_rate if oracle.hit_rate else 0.0
        fewer = p2c.prefill_tokens / ours.prefill_tokens if ours.prefill_tokens else 0.0
        lines += [
            _verdict(share >= 0.9, f"multi-turn: prefix hit rate {share:.1%} of the oracle's"),
            _verdict(fewer >= 2.0, f"multi-turn: {fewer:.2f}x fewer prefill tokens than p2c"),
            _verdict(ours.imbalance <= 1.25, f"multi-turn: max/mean load {ours.imbalance:.2f}"),
        ]
    ours, p2c = by.get(("no-reuse", "prefix")), by.get(("no-reuse", "p2c"))
    if ours and p2c:
        for name in ("prefill_tokens", "ttft_p50_s", "ttft_p99_s", "goodput_rps", "imbalance"):
            a, b = getattr(ours, name), getattr(p2c, name)
            diff = abs(a - b) / b if b else 0.0
            lines.append(_verdict(diff <= 0.05, f"no-reuse: {name} prefix vs p2c {diff:+.1%}"))
    return lines


def _verdict(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'MISS'}  {text}"


async def run(
    traces: Sequence[str],
    policies: Sequence[str],
    seed: int,
    placement: Mapping[str, Any],
    say: Any,
) -> list[Figures]:
    figures = []
    for name in traces:
        sessions = build(name, seed)
        say(f"{name}: {len(sessions)} sessions, {request_count(sessions)} requests")
        say(chunking_cost(sessions))
        for policy in policies:
            result = await run_policy(name, sessions, policy, seed, placement)
            say(f"  {policy}: {result.wall_s:.1f} s")
            for error in sorted(set(result.errors)):
                say(f"    failed: {error}")
            figures.append(result)
    return figures


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="narwhal bench --placement", description=__doc__)
    parser.add_argument("--placement", action="store_true", required=True)
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [placement] key for every router, e.g. load_slack=0.25 (JSON value)",
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    traces = [t for t in args.traces.split(",") if t]
    unknown = [t for t in traces if t not in TRACES]
    if unknown:
        parser.error(f"unknown trace(s) {', '.join(unknown)}; traces: {', '.join(TRACES)}")

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    policies = [p for p in args.policies.split(",") if p]
    if any(p not in POLICIES for p in policies):
        parser.error(f"policies: {', '.join(POLICIES)}")
    placement = {k: orjson.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    figures = runtime.run(run(traces, policies, args.seed, placement, say))
    print(table(figures))
    print(f"SLOs: TTFT <= {SLO_TTFT_S * 1000:.0f} ms, TPOT <= {SLO_TPOT_S * 1000:.0f} ms")
    for line in verdicts(figures):
        print(line)
    if args.json:
        with open(args.json, "wb") as out:
            out.write(orjson.dumps([asdict(f) for f in figures], option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

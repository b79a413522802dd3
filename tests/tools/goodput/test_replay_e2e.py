"""End to end: three simulated engines behind the router, two traces, both static splits.

The engines' costs are shaped like a GPU's but slow and small (a prompt token costs 0.5 ms,
a decode step 10 ms plus 10% per extra sequence), so a few dozen requests show the effect
within seconds: a prefill-heavy trace needs prefill compute and is served best with two
prefill engines; a decode-heavy one wants its sequences spread over two decode engines.
Nothing is decided by the test: the splits are run and scored as `narwhal goodput` does.
"""

from __future__ import annotations

from narwhal.tools.goodput.replay import KV_LEASE_S, FleetProcess, run_split
from narwhal.tools.goodput.score import ALL, Slo, best_split, split_stats
from narwhal.tools.goodput.traces import generate, phase_durations

FIELDS = {
    "profile": "dev",
    "request_overhead_s": 0.0,
    "prefill_s_per_token": 0.0005,
    "inter_token_s": 0.01,
    "slowdown_per_seq": 0.1,
    "kv_pull_s_per_block": 0.0,
    "kv_lease_s": KV_LEASE_S,
}
SLO = Slo(ttft_s=0.6, tpot_s=0.014)
DURATION_S = 3.0


async def test_prefill_heavy_load_prefers_more_prefill_engines_than_decode_heavy() -> None:
    # Prefill-heavy: ~400-token prompts (0.2 s each) and a few output tokens, 8 a second:
    # more than one engine's prefill can take. Decode-heavy: ~20-token prompts and ~60
    # output tokens, 8 a second: one decode engine's batch slows every step.
    traces = {
        "prefill-heavy": generate("prefill-heavy", seed=1, duration_s=DURATION_S, rate=8,
                                  cycles=1, token_scale=0.13),
        "decode-heavy": generate("decode-heavy", seed=1, duration_s=DURATION_S, rate=8,
                                 cycles=1, token_scale=0.08),
    }  # fmt: skip
    best: dict[str, int | None] = {}
    async with FleetProcess(3, dict(FIELDS)) as fleet:
        for name, trace in traces.items():
            durations = phase_durations(trace, DURATION_S)
            results = {}
            for prefill in (1, 2):
                run = await run_split(fleet, prefill, trace, speed=1.0)
                assert all(outcome.completed for outcome in run.outcomes)
                results[prefill] = split_stats(run.outcomes, SLO, durations)
            best[name] = best_split(results, ALL)
    assert best["prefill-heavy"] == 2
    assert best["decode-heavy"] == 1

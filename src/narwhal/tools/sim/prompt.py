"""Paying for a request's prompt: a KV pull, prefix-cache hits, or compute in the steps.

Whichever way a prompt's KV arrives is counted as vLLM 0.32's `/metrics` counts it
(`vllm:prompt_tokens_by_source`), since the router reads those counters as proof that a
handoff moved KV rather than being silently recomputed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from narwhal.tools.sim.api import ApiError, InferenceRequest
from narwhal.tools.sim.faults import Fault
from narwhal.tools.sim.handoff import pull_prompt
from narwhal.tools.sim.kv import PrefixCache, PullError, block_digests
from narwhal.tools.sim.metrics import Counters
from narwhal.tools.sim.options import SimOptions
from narwhal.tools.sim.steps import StepLoop


@dataclass(frozen=True, slots=True)
class Prompt:
    """A processed prompt: its block digests and where its tokens' KV came from."""

    digests: list[bytes]
    tokens: int
    cached_tokens: int


async def process_prompt(
    options: SimOptions,
    inference: InferenceRequest,
    fault: Fault,
    response_id: str,
    *,
    prefix_cache: PrefixCache,
    counters: Counters,
    steps: StepLoop,
) -> Prompt:
    """Pay for the prompt (pull, cache hit or compute) and count where its KV came from;
    a failed pull is a 500, or a recompute under the `recompute` policy."""
    block_size = options.kv_block_size
    tokens = inference.prompt_tokens
    digests = block_digests(tokens, block_size)
    full_blocks = len(tokens) // block_size
    local_tokens = prefix_cache.cached_blocks(digests[:full_blocks]) * block_size
    cached_tokens = local_tokens
    if inference.is_remote_decode:
        assert inference.kv_transfer_params is not None
        try:
            await pull_prompt(
                inference.kv_transfer_params,
                digests,
                response_id,
                fault=fault,
                costs=options.pull_costs,
                block_size=block_size,
            )
            # The pulled blocks cover the prompt; the last token is recomputed.
            cached_tokens = len(tokens)
        except PullError as exc:
            counters.nixl_failed_transfers += 1
            if options.kv_load_failure_policy == "fail":
                raise ApiError(500, f"KV transfer failed: {exc}") from exc
    compute_tokens = max(1, len(tokens) - cached_tokens)
    counters.local_compute += compute_tokens
    counters.prefix_cache_queries += len(tokens)
    counters.prefix_cache_hits += min(local_tokens, len(tokens) - 1)
    counters.local_cache_hit += min(local_tokens, len(tokens) - compute_tokens)
    counters.external_kv_transfer += max(0, len(tokens) - compute_tokens - local_tokens)
    # The frontend's share (HTTP, tokenizing) comes first; the prompt then joins the
    # engine's steps, sharing their token budget with other prompts and the decodes.
    await asyncio.sleep(options.request_overhead_s / options.speed)
    await steps.prefill(compute_tokens)
    prefix_cache.add(digests[:full_blocks])
    return Prompt(digests, len(tokens), min(local_tokens, len(tokens) - compute_tokens))

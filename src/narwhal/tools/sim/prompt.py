"""Paying for a request's prompt: a KV pull, prefix-cache hits, or compute in the steps.

Whichever way a prompt's KV arrives is counted as vLLM 0.32's `/metrics` counts it
(`vllm:prompt_tokens_by_source`), since the router reads those counters as proof that a
handoff moved KV rather than being silently recomputed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from narwhal.tools.sim.api import ApiError, InferenceRequest
from narwhal.tools.sim.faults import Fault
from narwhal.tools.sim.handoff import Handoff, pull_prompt
from narwhal.tools.sim.kv import IncompatibleKV, PrefixCache, PullError, block_digests
from narwhal.tools.sim.metrics import Counters
from narwhal.tools.sim.model import Generation
from narwhal.tools.sim.options import SimOptions
from narwhal.tools.sim.responses import Usage
from narwhal.tools.sim.steps import StepLoop


@dataclass(frozen=True, slots=True)
class Prompt:
    """A processed prompt: its block digests and where its tokens' KV came from.

    `weights` is what the text goes on to be generated with (see `kv_weights`);
    `computed_tokens` the prompt tokens this engine computed itself (neither cached nor
    pulled)."""

    digests: list[bytes]
    tokens: int
    cached_tokens: int
    weights: str | None = None
    computed_tokens: int = 0


def kv_weights(producer_adapter: str | None, consumer_adapter: str | None) -> str | None:
    """What a decode generates with: its own adapter, unless its prompt's KV was computed
    with other weights. Then the text is wrong for both (vLLM does not check a pulled
    block's adapter): a third text, neither the producer's nor the consumer's."""
    if producer_adapter == consumer_adapter:
        return consumer_adapter
    return f"kv:{producer_adapter or ''}|decode:{consumer_adapter or ''}"


async def process_prompt(
    options: SimOptions,
    inference: InferenceRequest,
    fault: Fault,
    response_id: str,
    *,
    prefix_cache: PrefixCache,
    counters: Counters,
    steps: StepLoop,
    record: Callable[[Handoff], None] = lambda handoff: None,
) -> Prompt:
    """Pay for the prompt (pull, cache hit or compute) and count where its KV came from;
    a failed pull is a 500, or a recompute under the `recompute` policy. Each pull is
    told to `record`."""
    block_size = options.kv_block_size
    tokens = inference.prompt_tokens
    digests = block_digests(tokens, block_size, inference.adapter)
    full_blocks = len(tokens) // block_size
    local_tokens = prefix_cache.cached_blocks(digests[:full_blocks]) * block_size
    cached_tokens = local_tokens
    weights = inference.adapter
    if inference.is_remote_decode:
        params = inference.kv_transfer_params
        assert params is not None
        remote_id, remote_engine = params.get("remote_request_id"), params.get("remote_engine_id")

        def handoff(model: str | None, adapter: str | None, ok: bool) -> Handoff:
            return Handoff(
                request_id=response_id,
                remote_request_id=remote_id if isinstance(remote_id, str) else None,
                producer_engine_id=remote_engine if isinstance(remote_engine, str) else None,
                producer_model=model,
                producer_adapter=adapter,
                consumer_model=options.model,
                consumer_adapter=inference.adapter,
                blocks=len(digests),
                ok=ok,
            )

        try:
            pulled = await pull_prompt(
                params,
                tokens,
                response_id,
                fault=fault,
                costs=options.pull_costs,
                block_size=block_size,
                model=options.model,
            )
            record(handoff(pulled.model, pulled.adapter, True))
            if pulled.adapter != inference.adapter:
                counters.crossed_adapter_pulls += 1
            weights = kv_weights(pulled.adapter, inference.adapter)
            # The pulled blocks cover the prompt; the last token is recomputed.
            cached_tokens = len(tokens)
        except PullError as exc:
            producer = exc.producer_model if isinstance(exc, IncompatibleKV) else None
            record(handoff(producer, None, False))
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
    cached = min(local_tokens, len(tokens) - compute_tokens)
    return Prompt(digests, len(tokens), cached, weights, compute_tokens)


def usage(
    options: SimOptions, inference: InferenceRequest, generation: Generation, prompt: Prompt
) -> Usage:
    """The request's usage as vLLM 0.32 reports it.

    Cached tokens (only with `enable_prompt_tokens_details`) are the local prefix-cache
    hits; a decode whose KV came over the side channel reports the producer's own
    hits instead (`remote_prefill_cached_tokens`), not the pulled tokens: so 0 for a
    prompt the producer computed. Reasoning tokens are counted when a reasoning parser
    is on (chat only).
    """
    cached = None
    if options.enable_prompt_tokens_details:
        cached = reported_cached_tokens(inference, prompt)
    reasoning = None
    if options.reasoning_tokens and inference.route == "chat":
        reasoning = min(options.reasoning_tokens, generation.completion_tokens)
    return Usage(len(inference.prompt_tokens), generation.completion_tokens, cached, reasoning)


def reported_cached_tokens(inference: InferenceRequest, prompt: Prompt) -> int:
    """The cached prompt tokens vLLM 0.32 reports for a request (its `num_cached_tokens`):
    the local prefix-cache hits, or for a decode whose KV came over the side channel the
    producer's own hits (`remote_prefill_cached_tokens`)."""
    params = inference.kv_transfer_params
    remote = params.get("remote_prefill_cached_tokens") if params else None
    if inference.is_remote_decode and type(remote) is int:
        return remote
    return prompt.cached_tokens


def cache_write_tokens(options: SimOptions, prompt: Prompt) -> int:
    """The prompt tokens a request newly wrote to the prefix cache, as vLLM 0.32 counts
    them (`num_cache_creation_tokens`): its whole prompt blocks, less the tokens it did not
    compute itself."""
    size = options.kv_block_size
    return max(0, prompt.tokens // size * size - (prompt.tokens - prompt.computed_tokens))

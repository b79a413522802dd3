"""How long an engine step and a KV pull take: pure arithmetic over the engine's state.

An engine works in steps, as vLLM's scheduler does. Each step runs every decoding sequence
one token and fills what is left of a token budget (`max_num_batched_tokens`) with chunks
of waiting prompts, first come first served (chunked prefill). A step costs:

    step_overhead_s                              every step (scheduling, launches, sampling)
  + prefill_s_per_token * prompt tokens in it    compute-bound: ~2 * params FLOPs a token
  + when it decodes anything:
      inter_token_s * (1 + slowdown_per_seq * (sequences - 1))
                                                 weights read once, plus per-sequence work
    + kv_read_s_per_token * context tokens       memory-bound: every sequence's KV is read

so time to first token grows with the prompt tokens queued ahead, time per output token
grows with batch size and context, and prompt chunks in a step stall the decodes beside
them. The costs add rather than overlap (no roofline max): a conservative, simple model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCosts:
    """The cost parameters of one engine's steps, in seconds (already divided by `speed`)."""

    step_overhead_s: float = 0.0
    prefill_s_per_token: float = 0.0
    inter_token_s: float = 0.0
    slowdown_per_seq: float = 0.0
    kv_read_s_per_token: float = 0.0
    max_num_batched_tokens: int = 8192

    def scaled(self, speed: float) -> StepCosts:
        """The same engine run `speed` times faster (trace replay compresses time)."""
        return StepCosts(
            self.step_overhead_s / speed,
            self.prefill_s_per_token / speed,
            self.inter_token_s / speed,
            self.slowdown_per_seq,
            self.kv_read_s_per_token / speed,
            self.max_num_batched_tokens,
        )

    @property
    def decode_is_free(self) -> bool:
        """A decode step costs nothing: tokens need not wait for steps at all."""
        return (
            self.step_overhead_s == 0
            and self.inter_token_s == 0
            and (self.kv_read_s_per_token == 0)
        )


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step runs: a chunk per waiting prompt (0: none this step) and the decodes."""

    chunks: tuple[int, ...]
    decode_seqs: int
    context_tokens: int

    @property
    def prefill_tokens(self) -> int:
        return sum(self.chunks)


def plan_step(
    waiting_prompt_tokens: Sequence[int],
    decode_contexts: Sequence[int],
    max_num_batched_tokens: int,
) -> StepPlan:
    """Decodes first (one token each), then prompt chunks in arrival order within the budget.

    Like vLLM's scheduler, running sequences go first so prompts cannot starve them; a
    prompt larger than what is left is chunked and continues next step. At least one
    prompt token runs when nothing decodes, so a tiny budget still makes progress.
    """
    left = max_num_batched_tokens - len(decode_contexts)
    if not decode_contexts:
        left = max(left, 1)
    chunks: list[int] = []
    for remaining in waiting_prompt_tokens:
        chunk = max(0, min(remaining, left))
        chunks.append(chunk)
        left -= chunk
    return StepPlan(tuple(chunks), len(decode_contexts), sum(decode_contexts))


def step_seconds(costs: StepCosts, plan: StepPlan) -> float:
    """How long the planned step takes (0 when it runs nothing)."""
    if not plan.decode_seqs and not plan.prefill_tokens:
        return 0.0
    seconds = costs.step_overhead_s + costs.prefill_s_per_token * plan.prefill_tokens
    if plan.decode_seqs:
        batch = 1 + costs.slowdown_per_seq * (plan.decode_seqs - 1)
        seconds += costs.inter_token_s * batch
        seconds += costs.kv_read_s_per_token * plan.context_tokens
    return seconds


@dataclass(frozen=True, slots=True)
class PullCosts:
    """A KV pull's cost: a fixed latency, a per-block cost and bytes over a link."""

    latency_s: float = 0.0
    s_per_block: float = 0.0
    bytes_per_token: int = 0
    bytes_per_s: float = 0.0  # 0: the link is not modelled (no size cost)

    def scaled(self, speed: float) -> PullCosts:
        return PullCosts(
            self.latency_s / speed,
            self.s_per_block / speed,
            self.bytes_per_token,
            self.bytes_per_s * speed,
        )


def pull_seconds(costs: PullCosts, blocks: int, block_size: int) -> float:
    """How long a consumer waits to pull `blocks` KV blocks of `block_size` tokens."""
    if blocks <= 0:
        return 0.0
    seconds = costs.latency_s + costs.s_per_block * blocks
    if costs.bytes_per_s > 0:
        seconds += blocks * block_size * costs.bytes_per_token / costs.bytes_per_s
    return seconds

"""The step and pull cost model: budgets, monotonic costs, scaling (properties by hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.tools.sim.timing import (
    PullCosts,
    StepCosts,
    StepPlan,
    plan_step,
    pull_seconds,
    step_seconds,
)

COSTS = StepCosts(
    step_overhead_s=0.001,
    prefill_s_per_token=0.0001,
    inter_token_s=0.01,
    slowdown_per_seq=0.01,
    kv_read_s_per_token=1e-6,
    max_num_batched_tokens=512,
)

prompts = st.lists(st.integers(min_value=1, max_value=5000), max_size=8)
contexts = st.lists(st.integers(min_value=1, max_value=8000), max_size=64)
budgets = st.integers(min_value=1, max_value=16384)


@given(prompts, contexts, budgets)
def test_a_step_stays_within_its_token_budget(
    waiting: list[int], decoding: list[int], budget: int
) -> None:
    plan = plan_step(waiting, decoding, budget)
    assert len(plan.chunks) == len(waiting)
    assert all(0 <= chunk <= left for chunk, left in zip(plan.chunks, waiting, strict=True))
    if len(decoding) <= budget:
        assert plan.prefill_tokens + plan.decode_seqs <= max(budget, 1)
    assert plan.decode_seqs == len(decoding) and plan.context_tokens == sum(decoding)


@given(prompts, contexts, budgets)
def test_prompts_are_served_in_arrival_order(
    waiting: list[int], decoding: list[int], budget: int
) -> None:
    """A later prompt gets tokens only once every earlier one got all it still needs."""
    plan = plan_step(waiting, decoding, budget)
    for i, chunk in enumerate(plan.chunks):
        if chunk:
            assert plan.chunks[:i] == tuple(waiting[:i])


@given(prompts.filter(bool), budgets)
def test_an_engine_without_decodes_always_makes_prefill_progress(
    waiting: list[int], budget: int
) -> None:
    assert plan_step(waiting, [], budget).prefill_tokens >= 1


def test_decodes_go_first_and_prompts_share_what_is_left() -> None:
    plan = plan_step([300, 300], [100] * 12, 512)
    assert plan.chunks == (300, 200)
    assert plan_step([300, 300], [100] * 600, 512).chunks == (0, 0)


@given(st.integers(0, 10000), st.integers(0, 256), st.integers(0, 10**6), st.integers(1, 1000))
def test_a_step_costs_more_with_more_work_of_any_kind(
    prefill: int, seqs: int, context: int, extra: int
) -> None:
    base = step_seconds(COSTS, StepPlan((prefill,), seqs, context))
    assert step_seconds(COSTS, StepPlan((prefill + extra,), seqs, context)) > base
    assert step_seconds(COSTS, StepPlan((prefill,), seqs + 1, context)) > base
    if seqs:
        assert step_seconds(COSTS, StepPlan((prefill,), seqs, context + extra)) > base


def test_an_empty_step_costs_nothing() -> None:
    assert step_seconds(COSTS, StepPlan((0, 0), 0, 0)) == 0.0


def test_a_lone_decode_costs_the_overhead_and_the_weight_read() -> None:
    assert step_seconds(COSTS, StepPlan((), 1, 0)) == pytest.approx(0.011)


def test_prompt_tokens_in_a_step_stall_its_decodes() -> None:
    alone = step_seconds(COSTS, StepPlan((), 8, 8000))
    beside_a_prompt = step_seconds(COSTS, StepPlan((500,), 8, 8000))
    assert beside_a_prompt == pytest.approx(alone + 500 * COSTS.prefill_s_per_token)


def test_decode_time_grows_with_batch_and_context() -> None:
    one = step_seconds(COSTS, StepPlan((), 1, 1000))
    many = step_seconds(COSTS, StepPlan((), 64, 64000))
    assert many == pytest.approx(0.001 + 0.01 * (1 + 0.01 * 63) + 64000e-6)
    assert many > one


@given(st.floats(min_value=0.01, max_value=100))
def test_speed_divides_every_duration(speed: float) -> None:
    plan = StepPlan((100,), 4, 4000)
    scaled = COSTS.scaled(speed)
    assert step_seconds(scaled, plan) == pytest.approx(step_seconds(COSTS, plan) / speed)
    pull = PullCosts(0.002, 0.0001, 131072, 40e9)
    assert pull_seconds(pull.scaled(speed), 10, 16) == pytest.approx(
        pull_seconds(pull, 10, 16) / speed
    )


def test_free_decodes_are_recognised() -> None:
    assert StepCosts(prefill_s_per_token=0.1).decode_is_free
    assert not StepCosts(inter_token_s=0.01).decode_is_free
    assert not StepCosts(step_overhead_s=0.01).decode_is_free


def test_a_pull_waits_latency_plus_bytes_over_bandwidth() -> None:
    costs = PullCosts(latency_s=0.002, bytes_per_token=131072, bytes_per_s=40e9)
    # 100 blocks of 16 tokens of 128 KiB: 210 MB at 40 GB/s.
    assert pull_seconds(costs, 100, 16) == pytest.approx(0.002 + 100 * 16 * 131072 / 40e9)
    assert pull_seconds(costs, 0, 16) == 0.0
    assert pull_seconds(PullCosts(s_per_block=0.001), 7, 16) == pytest.approx(0.007)


@given(st.integers(1, 10000), st.integers(1, 10000))
def test_pulls_cost_more_with_more_blocks(blocks: int, more: int) -> None:
    costs = PullCosts(latency_s=0.001, s_per_block=1e-5, bytes_per_token=1000, bytes_per_s=1e9)
    assert pull_seconds(costs, blocks + more, 16) > pull_seconds(costs, blocks, 16)

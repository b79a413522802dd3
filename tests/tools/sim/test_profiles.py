"""Preset profiles: first-principles numbers in the expected range, and `--profile` flags."""

from __future__ import annotations

import argparse

import pytest

from narwhal.tools.sim.options import (
    SimOptions,
    add_sim_arguments,
    options_from_args,
    profile_options,
)
from narwhal.tools.sim.profiles import (
    LLAMA_3_1_8B,
    LLAMA_3_1_70B,
    PROFILE_FIELDS,
    PROFILES,
    profile,
)
from narwhal.tools.sim.timing import StepPlan, step_seconds


def _parse(*argv: str) -> SimOptions:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return options_from_args(parser.parse_args(argv))


def test_kv_bytes_per_token_follow_the_model_shape() -> None:
    assert LLAMA_3_1_8B.kv_bytes_per_token == 128 * 1024  # 32 layers, 8 KV heads of 128
    assert LLAMA_3_1_70B.kv_bytes_per_token == 320 * 1024


def test_the_8b_profile_is_in_the_range_published_for_an_h100() -> None:
    costs = profile_options("llama-3.1-8b-h100").step_costs
    lone = step_seconds(costs, StepPlan((), 1, 1000))
    assert 0.005 < lone < 0.009  # ~140 tokens/s for one stream
    # A full batch of 256 at ~500 tokens of context: ~10k output tokens/s in all.
    full = step_seconds(costs, StepPlan((), 256, 256 * 500))
    assert 7000 < 256 / full < 14000
    # An 8k-token prompt in one step: tens of thousands of prompt tokens per second.
    assert 0.15 < step_seconds(costs, StepPlan((8192,), 0, 0)) < 0.5


def test_the_70b_profile_is_slower_per_token_than_the_8b() -> None:
    big = profile_options("llama-3.1-70b-h100-tp4")
    small = profile_options("llama-3.1-8b-h100")
    assert big.inter_token_s > small.inter_token_s
    assert big.prefill_s_per_token > small.prefill_s_per_token
    assert big.tp_size == 4


def test_every_profile_builds_valid_options() -> None:
    for name in PROFILES:
        options = profile_options(name)
        assert set(profile(name)) <= set(PROFILE_FIELDS)
        assert options.num_kv_blocks >= 1


def test_the_dev_profile_is_the_default() -> None:
    assert profile_options("dev") == SimOptions() == _parse("--port", "0")


def test_a_profile_flag_sets_its_values_and_a_field_flag_overrides_one() -> None:
    options = _parse("--profile", "llama-3.1-8b-h100", "--inter-token-s", "0.01", "--speed", "2")
    assert options.inter_token_s == 0.01
    assert options.prefill_s_per_token == PROFILES["llama-3.1-8b-h100"]["prefill_s_per_token"]
    assert options.speed == 2.0
    assert options.step_costs.inter_token_s == pytest.approx(0.005)


def test_field_flags_work_without_a_profile() -> None:
    options = _parse("--max-num-batched-tokens", "2048", "--kv-pull-bytes-per-s", "1e9")
    assert (options.max_num_batched_tokens, options.kv_pull_bytes_per_s) == (2048, 1e9)


def test_an_unknown_profile_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        _parse("--profile", "gpt-5-on-a-toaster")
    with pytest.raises(ValueError, match="presets"):
        profile("nope")

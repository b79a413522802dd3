"""The tenants experiments script: which experiments `--only` picks, and its plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from tenant_experiments import EXPERIMENTS, chosen, parser, plan_from_args


def test_only_picks_experiments_in_their_order() -> None:
    assert chosen(None) == EXPERIMENTS
    assert chosen("cpu, weights") == ("weights", "cpu")
    with pytest.raises(ValueError, match="experiments are"):
        chosen("everything")


def test_the_plan_takes_the_flags() -> None:
    args = parser().parse_args(
        ["--decode-seats", "16", "--objective-s", "1", "--baseline", "old/src", "--run-s", "9"]
    )
    plan = plan_from_args(args)
    assert plan.shape.decode_seats == 16 and plan.objective_s == 1.0 and plan.run_s == 9.0
    assert plan.baseline == Path("old/src").resolve()

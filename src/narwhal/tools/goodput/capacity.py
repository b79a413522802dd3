"""A rough request rate for a trace phase: what the fleet can serve, from the step costs.

Pure. Used only when `narwhal goodput` is given no `--rate`: it aims the load near the
fleet's capacity, where the choice of split matters (far below it every split is good,
far above it none is).
"""

from __future__ import annotations

from narwhal.tools.goodput.traces import Mix
from narwhal.tools.sim.timing import StepCosts, StepPlan, step_seconds

NOMINAL_BATCH = 32
"""Decode batch assumed for the estimate (a busy engine runs tens of sequences)."""

LOAD = 0.8
"""Offered load as a share of the estimated capacity."""


def engine_seconds(costs: StepCosts, mix: Mix) -> float:
    """Engine time one average request takes: its prompt, and its share of decode steps."""
    context = int(mix.mean_prompt + mix.mean_output / 2)
    step = step_seconds(costs, StepPlan((), NOMINAL_BATCH, NOMINAL_BATCH * context))
    return mix.mean_prompt * costs.prefill_s_per_token + mix.mean_output * step / NOMINAL_BATCH


def suggested_rate(costs: StepCosts, engines: int, mix: Mix, load: float = LOAD) -> float:
    """Requests per second that keep `engines` engines about `load` busy."""
    return load * engines / engine_seconds(costs, mix)

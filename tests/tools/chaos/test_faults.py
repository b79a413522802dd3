"""The soak's faults: every fault the simulator has is drawn, and each can be armed."""

from __future__ import annotations

import dataclasses
import random

from narwhal.tools.chaos.faults import FAULTS
from narwhal.tools.sim.faults import Fault


def test_the_soak_draws_every_fault_the_simulator_has_and_each_can_be_armed() -> None:
    rng = random.Random(0)
    drawn = [draw(rng) for draw in FAULTS.values() for _ in range(20)]
    for fault in drawn:
        Fault.from_json(fault)
    keys = {key for fault in drawn for key in fault}
    assert keys == {field.name for field in dataclasses.fields(Fault)} - {"times"}

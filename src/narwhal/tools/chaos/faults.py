"""The faults a soak injects: a random fault armed on a random engine every so often, and
outages that take an engine down and bring it back."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping

from narwhal.tools.chaos.downtime import Downtime
from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.faults import Fault

FaultDraw = Callable[[random.Random], dict[str, object]]


def _silence(rng: random.Random) -> dict[str, object]:
    return {
        "phase": "decode",
        "silence_after": rng.randint(0, 4),
        "silence_s": rng.uniform(0.2, 1.0),
        "silence_metadata": rng.random() < 0.5,
    }


# Every fault the simulator has, each drawn with its own random shape. `crash` drops the
# engine when a request trips it; the run restarts it a little later.
FAULTS: dict[str, FaultDraw] = {
    "status": lambda rng: {
        "phase": rng.choice(["prefill", "decode"]),
        "status": rng.choice([400, 429, 500, 502, 503, 504]),
    },
    "hang_s": lambda rng: {
        "phase": rng.choice(["prefill", "decode"]),
        "hang_s": rng.uniform(0.2, 1.5),
    },
    "first_token_delay_s": lambda rng: {
        "phase": "decode",
        "first_token_delay_s": rng.uniform(0.1, 1.2),
    },
    "silence": _silence,
    "close_after": lambda rng: {"phase": "decode", "close_after": rng.randint(0, 4)},
    "done_before_token": lambda rng: {"phase": "decode", "done_before_token": True},
    "error_after": lambda rng: {
        "phase": "decode",
        "error_after": rng.randint(0, 4),
        "error_code": rng.choice([400, 429, 500, 503]),
    },
    "descriptor": lambda rng: {
        "phase": "prefill",
        "descriptor": rng.choice(
            ["missing_engine_id", "non_integer_block_ids", "negative_block_ids", "null"]
        ),
    },
    "kv_pull_delay_s": lambda rng: {"phase": "decode", "kv_pull_delay_s": rng.uniform(0.05, 1.0)},
    "kv_pull_fail": lambda rng: {"phase": "decode", "kv_pull_fail": True},
    "refuse_s": lambda rng: {"refuse_s": rng.uniform(0.1, 1.0)},
    "crash": lambda rng: {"phase": rng.choice(["prefill", "decode"]), "crash": True},
    # A consumer that dies mid-answer: what stream continuation rescues.
    "crash_after": lambda rng: {"phase": "decode", "crash_after": rng.randint(1, 6)},
}
OUTAGE = "outage"  # not a fault but an act: crash() an engine now, restart() it later


class Outages:
    """Takes engines down and brings them back, one outage at a time per engine, and
    records in `downtime` whenever any engine stops or starts accepting connections."""

    def __init__(
        self, engines: Mapping[str, SimEngine], rng: random.Random, downtime: Downtime
    ) -> None:
        self._engines = engines
        self._rng = rng
        self._down: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.errors: list[str] = []
        self.downtime = downtime

    def listening(self, name: str, accepting: bool) -> None:
        """The engine's listener opened or closed: an outage, a crash fault, a restart, or
        a `refuse_s` fault firing (on the next request after it is armed, for `refuse_s`,
        as many times as armed), each known when it happens rather than guessed."""
        if accepting:
            self.downtime.up(name, time.time())
        else:
            self.downtime.down(name, time.time())

    def crashed(self, name: str) -> None:
        """A `crash` fault fired: the engine is gone until restarted."""
        self._start(name, crash=False)

    def outage(self, name: str) -> None:
        self._start(name, crash=True)

    def _start(self, name: str, *, crash: bool) -> None:
        if name in self._down:
            return
        self._down.add(name)
        task = asyncio.create_task(self._cycle(name, crash, self._rng.uniform(0.2, 1.5)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cycle(self, name: str, crash: bool, down_s: float) -> None:
        engine = self._engines[name]
        try:
            if crash:
                await engine.crash()
            await asyncio.sleep(down_s)
            await engine.restart()
        except Exception as exc:
            self.errors.append(f"restarting engine {name} failed: {exc!r}")
        finally:
            self._down.discard(name)

    async def end(self) -> None:
        """Wait until every engine taken down is back."""
        while self._tasks:
            await asyncio.gather(*self._tasks)


async def inject(
    engines: Mapping[str, SimEngine],
    outages: Outages,
    rng: random.Random,
    every_s: float,
    counts: Counter[str],
) -> None:
    """Arm a random fault (or cause an outage) on a random engine, until cancelled."""
    kinds = [*FAULTS, OUTAGE]
    while True:
        await asyncio.sleep(rng.expovariate(1 / every_s))
        name = rng.choice(sorted(engines))
        kind = rng.choice(kinds)
        counts[kind] += 1
        if kind == OUTAGE:
            outages.outage(name)
        else:
            fault = Fault.from_json({**FAULTS[kind](rng), "times": rng.randint(1, 3)})
            engines[name].set_fault(fault)

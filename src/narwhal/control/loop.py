"""The role controller at work: every `interval_s` it observes the fleet, asks
`controller.decide` for its moves (usually at most one), and applies them through
`operations` (the same role table the breaker, readmission and placement use), or, in
advisory mode, only journals them. Every move (or advice) is an engine event with its
reason and inputs; the last decision, the split and a short timeline are in
`/narwhal/state`.

The observation is the latency window (requests still waiting past the TTFT objective
included, see `phase_latency`), the router's seat queue and, from the engines' last
`/metrics` readings, their queues and their mean queue time since the last observation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from narwhal.config.controller import ControllerConfig, SloConfig
from narwhal.config.engine_spec import Role
from narwhal.control.controller import (
    ControlState,
    Decision,
    EngineView,
    Move,
    Observation,
    PhaseLoad,
    after,
    decide,
)
from narwhal.control.phase_latency import PhaseLatency
from narwhal.fleet.operations import FleetOperations, OperationError
from narwhal.fleet.table import Engine, EngineEvent, EngineState, Fleet, Phase

log = logging.getLogger("narwhal.controller")

TIMELINE = 50
IN_SERVICE = frozenset({EngineState.ADMITTED, EngineState.QUARANTINED})

ObservationSource = Callable[[float], Observation]


class ControlLoop:
    """One router's role controller; `step` is one decision, `run` the periodic loop."""

    def __init__(
        self,
        fleet: Fleet,
        operations: FleetOperations,
        config: ControllerConfig,
        slo: SloConfig,
        latency: PhaseLatency,
        *,
        source: ObservationSource | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.fleet = fleet
        self.operations = operations
        self.config = config
        self.slo = slo
        self.latency = latency
        self.source = source or self.observe
        # The clock of the latency samples (`time.perf_counter()`, as requests are timed).
        self.clock = clock
        self.state = ControlState()
        self.started = 0.0
        self.last: Decision | None = None
        self.last_at: float | None = None
        self.moves: Counter[str] = Counter()
        self.advice: Counter[str] = Counter()
        self.timeline: deque[dict[str, Any]] = deque(maxlen=TIMELINE)
        # Each engine's queue time sum and count at the last observation.
        self._queue_marks: dict[str, tuple[float, float]] = {}

    def observe(self, now: float) -> Observation:
        """The fleet's role table and each phase's load over the window."""
        perf_now = self.clock()
        moved = self.state.last_move_at
        since = None if moved is None else perf_now - (now - moved)
        window = self.latency.window(perf_now, self.config.window_s, since, self.slo.ttft_s)
        engines = self.fleet.engines
        queue_times = self._queue_times(engines)
        wait = window.first_token_wait
        return Observation(
            now=now,
            engines=tuple(self._view(e, now) for e in engines),
            prefill=PhaseLoad(
                window.prefill.p90_s,
                window.prefill.samples,
                queued=self.fleet.queued,
                waiting=sum(e.reported_waiting for e in engines if e.serves(Phase.PREFILL)),
                seats_in_use=sum(e.prefill_seats for e in engines),
                pending=window.prefill.pending,
                queue_time_s=queue_times[Phase.PREFILL],
            ),
            decode=PhaseLoad(
                window.tpot.p90_s,
                window.tpot.samples,
                wait_p90_s=wait.p90_s,
                waiting=sum(e.reported_waiting for e in engines if e.serves(Phase.DECODE)),
                seats_in_use=sum(e.decode_seats for e in engines),
                pending=wait.pending,
                queue_time_s=queue_times[Phase.DECODE],
            ),
        )

    def _queue_times(self, engines: list[Engine]) -> dict[Phase, float | None]:
        """Each phase's mean engine queue time since the last observation (None: no
        request left an engine's queue in between, or none reports it)."""
        sums = {Phase.PREFILL: 0.0, Phase.DECODE: 0.0}
        counts = {Phase.PREFILL: 0.0, Phase.DECODE: 0.0}
        marks: dict[str, tuple[float, float]] = {}
        for engine in engines:
            report = engine.report
            if report is None or report.queue_time_sum is None or not report.queue_time_count:
                continue
            total, count = report.queue_time_sum, report.queue_time_count
            marks[engine.id] = (total, count)
            last_total, last_count = self._queue_marks.get(engine.id, (0.0, 0.0))
            if count < last_count:  # restarted: its counts began again
                last_total, last_count = 0.0, 0.0
            if engine.id not in self._queue_marks or count == last_count:
                continue
            for phase in (Phase.PREFILL, Phase.DECODE):
                if engine.serves(phase):
                    sums[phase] += max(0.0, total - last_total)
                    counts[phase] += count - last_count
        self._queue_marks = marks
        return {phase: sums[phase] / counts[phase] if counts[phase] else None for phase in sums}

    def _view(self, engine: Engine, now: float) -> EngineView:
        role = engine.role
        return EngineView(
            id=engine.id,
            role=role,
            capable=engine.spec.role is Role.BOTH,
            pinned=engine.pinned,
            in_service=not engine.draining and engine.state(now) in IN_SERVICE,
            since=self.started if engine.role_since is None else engine.role_since,
            busy=engine.prefill_seats if role is Role.PREFILL else engine.decode_seats,
        )

    def step(self, now: float) -> Decision:
        """Observe, decide, and apply (or only journal) the decision's moves."""
        decision = decide(self.source(now), self.state, self.config, self.slo)
        self.last, self.last_at = decision, now
        done = [move for move in decision.moves if self._apply(decision, move, now)]
        if not done:
            return decision
        # Advice counts as a move for the memory, so advisory mode decides as the real
        # controller would (the same cooldown, and no repeat on the same evidence).
        self.state = after(decision, self.state, now)
        stamp = round(time.time(), 3)
        self.timeline.extend(
            {
                "ts": stamp,
                "engine": move.engine,
                "from": move.old.value,
                "to": move.new.value,
                "reason": decision.reason,
                "applied": not self.config.advisory,
            }
            for move in done
        )
        return decision

    def _apply(self, decision: Decision, move: Move, now: float) -> bool:
        """One move applied (or, in advisory mode, journaled); False when refused."""
        why = decision.explain()
        if self.config.advisory:
            self.advice[decision.reason] += 1
            self.fleet.emit(
                EngineEvent(
                    "role_advice",
                    move.engine,
                    f"would move {move.old.value} -> {move.new.value}; {why}",
                    reason=decision.reason,
                    inputs=decision.inputs,
                )
            )
            return True
        try:
            self.operations.move(
                move.engine,
                move.new,
                f"role controller: {why}",
                reason=decision.reason,
                inputs=decision.inputs,
                now=now,
            )
        except OperationError as error:
            log.warning("role controller: move of %s refused: %s", move.engine, error.message)
            return False
        self.moves[decision.reason] += 1
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.started = loop.time()
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.step(loop.time())
            except Exception:  # one bad step must not stop the controller
                log.exception("role controller step failed")

    def summary(self) -> dict[str, Any]:
        """The controller in `/narwhal/state`."""
        last = self.last
        return {
            "enabled": self.config.enabled,
            "advisory": self.config.advisory,
            "interval_s": self.config.interval_s,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
            "split": split(self.fleet),
            "moves": dict(self.moves),
            "advice": dict(self.advice),
            "last_decision": None
            if last is None
            else {
                "move": None
                if last.move is None
                else {
                    "engine": last.move.engine,
                    "from": last.move.old.value,
                    "to": last.move.new.value,
                },
                "reason": last.reason,
                "detail": last.detail,
                "inputs": last.inputs,
            },
            "timeline": list(self.timeline),
        }


def split(fleet: Fleet) -> dict[str, int]:
    """Engines by the role they act in now."""
    counts = Counter(e.role.value for e in fleet.engines)
    return {role.value: counts.get(role.value, 0) for role in Role}


async def stop_task(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

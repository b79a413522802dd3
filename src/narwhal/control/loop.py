"""The role controller at work: every `interval_s` it observes the fleet, asks
`controller.decide` for its moves (usually at most one), and applies them through
`operations` (the same role table the breaker, readmission and placement use), or, in
advisory mode, only journals them. Every move (or advice) is an engine event with its
reason and inputs; the last decision, the split and a short timeline are in
`/narwhal/state`.

The observation is the latency window (requests still waiting past the TTFT objective
included, see `phase_latency`), the router's seat queue and, from the engines' last
`/metrics` readings, their queues and their mean queue time since the last observation.

With several pools (base models) it decides for each pool on its own: the pool's engines,
its requests' latencies, its seat queue, its own memory (cooldown) and its model's `[slo]`
where `[[models]]` sets one, else the router-wide `[slo]`; a move only ever changes the
phase of an engine of role `both` within its pool. With one pool nothing of that shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
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
        model_slo: Mapping[str, SloConfig] | None = None,
    ) -> None:
        """`model_slo`: the objectives of the models that set their own (`[[models]] slo`);
        a `source` given replaces the observation of the whole fleet as one pool."""
        self.fleet = fleet
        self.operations = operations
        self.config = config
        self.slo = slo
        self.latency = latency
        self.source = source or self.observe
        self._pooled = source is None
        self.model_slo = dict(model_slo or {})
        # The clock of the latency samples (`time.perf_counter()`, as requests are timed).
        self.clock = clock
        self.state = ControlState()
        self.started = 0.0
        self.last: Decision | None = None
        self.last_at: float | None = None
        # With several pools: each pool's memory and last decision.
        self.states: dict[str, ControlState] = {}
        self.last_by_model: dict[str, Decision] = {}
        self.moves: Counter[str] = Counter()
        self.advice: Counter[str] = Counter()
        self.timeline: deque[dict[str, Any]] = deque(maxlen=TIMELINE)
        # Each engine's queue time sum and count at the last observation.
        self._queue_marks: dict[str, tuple[float, float]] = {}

    def several(self) -> bool:
        """Whether it decides per pool: several base models, observed by the loop itself."""
        return self._pooled and len(self.fleet.models()) > 1

    def slo_of(self, model: str | None) -> SloConfig:
        """A pool's objectives: its model's own, else the router-wide ones."""
        return self.slo if model is None else self.model_slo.get(model, self.slo)

    def observe(self, now: float, model: str | None = None) -> Observation:
        """The role table and each phase's load over the window: of the whole fleet, or
        of one pool (`model`)."""
        perf_now = self.clock()
        state = self.state if model is None else self.states.get(model, ControlState())
        moved = state.last_move_at
        since = None if moved is None else perf_now - (now - moved)
        window = self.latency.window(
            perf_now, self.config.window_s, since, self.slo_of(model).ttft_s, model
        )
        engines = self.fleet.engines if model is None else self.fleet.pool(model)
        queue_times = self._queue_times(engines, whole=model is None)
        wait = window.first_token_wait
        return Observation(
            now=now,
            engines=tuple(self._view(e, now) for e in engines),
            prefill=PhaseLoad(
                window.prefill.p90_s,
                window.prefill.samples,
                queued=self.fleet.queued if model is None else self.fleet.queued_in(model),
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

    def _queue_times(
        self, engines: list[Engine], *, whole: bool = True
    ) -> dict[Phase, float | None]:
        """Each phase's mean engine queue time since the last observation (None: no
        request left an engine's queue in between, or none reports it); `whole`: the
        engines are the whole fleet (else one pool's, whose marks alone are renewed)."""
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
        if whole:
            self._queue_marks = marks
        else:
            for engine in engines:
                self._queue_marks.pop(engine.id, None)
            self._queue_marks.update(marks)
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
        """Observe, decide, and apply (or only journal) the decision's moves; with
        several pools, one decision per pool (the one returned: the first that moved,
        else the last pool's)."""
        if not self.several():
            decision = decide(self.source(now), self.state, self.config, self.slo)
            self.last, self.last_at = decision, now
            if self._done(decision, now, None):
                self.state = after(decision, self.state, now)
            return decision
        chosen: Decision | None = None
        for model in self.fleet.models():
            state = self.states.get(model, ControlState())
            decision = decide(self.observe(now, model), state, self.config, self.slo_of(model))
            decision = dataclasses.replace(decision, detail=f"model `{model}`: {decision.detail}")
            self.last_by_model[model] = decision
            if self._done(decision, now, model):
                self.states[model] = after(decision, state, now)
                chosen = chosen or decision
        self.last, self.last_at = chosen or decision, now
        return self.last

    def _done(self, decision: Decision, now: float, model: str | None) -> bool:
        """Apply a decision's moves; whether any was applied (or advised)."""
        done = [move for move in decision.moves if self._apply(decision, move, now)]
        if not done:
            return False
        # Advice counts as a move for the memory, so advisory mode decides as the real
        # controller would (the same cooldown, and no repeat on the same evidence).
        stamp = round(time.time(), 3)
        self.timeline.extend(
            {
                "ts": stamp,
                "engine": move.engine,
                "from": move.old.value,
                "to": move.new.value,
                "reason": decision.reason,
                "applied": not self.config.advisory,
                **({} if model is None else {"model": model}),
            }
            for move in done
        )
        return True

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
        pools = (
            {
                "pools": {
                    model: {
                        "slo": _slo(self.slo_of(model)),
                        "last_decision": _decision(self.last_by_model.get(model)),
                    }
                    for model in self.fleet.models()
                }
            }
            if self.several()
            else {}
        )
        return {
            "enabled": self.config.enabled,
            "advisory": self.config.advisory,
            "interval_s": self.config.interval_s,
            "slo": _slo(self.slo),
            "split": split(self.fleet),
            "moves": dict(self.moves),
            "advice": dict(self.advice),
            "last_decision": _decision(last),
            "timeline": list(self.timeline),
            **pools,
        }


def _slo(slo: SloConfig) -> dict[str, float]:
    return {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}


def _decision(decision: Decision | None) -> dict[str, Any] | None:
    if decision is None:
        return None
    move = decision.move
    return {
        "move": None
        if move is None
        else {"engine": move.engine, "from": move.old.value, "to": move.new.value},
        "reason": decision.reason,
        "detail": decision.detail,
        "inputs": decision.inputs,
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

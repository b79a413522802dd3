"""When each engine of a soak did not accept connections, and which engines serve each phase.

Times are wall-clock seconds (`time.time()`), the clock of the journal's `ts`. The record
grows with the number of outages and role moves, not with the number of requests. With the
role controller on, an engine serves a phase from one move to the next: `moved` records
each `role_change` the journal shows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Span = tuple[float, float]


class Downtime:
    """Each engine's down spans: from when it stopped accepting connections to when it
    started again (open-ended while it is still down)."""

    def __init__(self, serving: Mapping[str, Sequence[str]]) -> None:
        """`serving` maps a phase ("prefill", "decode") to the engines that serve it."""
        self.serving = {phase: tuple(engines) for phase, engines in serving.items()}
        self._spans: dict[str, list[list[float]]] = {}
        # Each moved engine's (since, phase), oldest first; its first phase before those.
        self._roles: dict[str, list[tuple[float, str]]] = {}
        self._first = {engine: phase for phase, names in serving.items() for engine in names}

    def moved(self, engine: str, phase: str, at: float) -> None:
        """From `at` on, `engine` serves `phase`."""
        self._roles.setdefault(engine, []).append((at, phase))

    def moves(self) -> list[tuple[float, str, str]]:
        """(when, engine, new phase) of every move, in time order."""
        return sorted((at, e, phase) for e, changes in self._roles.items() for at, phase in changes)

    def phase_at(self, engine: str, at: float) -> str | None:
        phase = self._first.get(engine)
        for since, moved_to in self._roles.get(engine, []):
            if since <= at:
                phase = moved_to
        return phase

    def serving_at(self, phase: str, at: float) -> tuple[str, ...]:
        return tuple(e for e in self._first if self.phase_at(e, at) == phase)

    def _ever_serving(self, phase: str, start: float, end: float) -> list[str]:
        """Engines that served `phase` at some moment of [start, end]."""
        moments = [start] + [at for at, _, _ in self.moves() if start < at <= end]
        return [e for e in self._first if any(self.phase_at(e, m) == phase for m in moments)]

    def down(self, engine: str, at: float) -> None:
        spans = self._spans.setdefault(engine, [])
        if not spans or spans[-1][1] != math.inf:
            spans.append([at, math.inf])

    def up(self, engine: str, at: float) -> None:
        spans = self._spans.get(engine)
        if spans and spans[-1][1] == math.inf:
            spans[-1][1] = at

    def spans(self, engine: str) -> list[Span]:
        return [(start, end) for start, end in self._spans.get(engine, [])]

    def all_down(self, phase: str, start: float, end: float, grace_s: float) -> bool:
        """Whether at some moment of [start, end] every engine serving `phase` was down, or
        back for less than `grace_s`."""
        engines = self._ever_serving(phase, start, end)
        near = {
            engine: [
                (down, up + grace_s)
                for down, up in self.spans(engine)
                if down <= end and up + grace_s >= start
            ]
            for engine in engines
        }
        # Where the serving engines' down spans all overlap, the overlap begins at `start`,
        # at the start of one of them or at a move: those are the only moments worth trying.
        moments = [start] + [down for spans in near.values() for down, _ in spans if down > start]
        moments += [at for at, _, _ in self.moves() if start < at <= end]
        return any(
            all(
                any(down <= moment <= up for down, up in near[engine])
                for engine in self.serving_at(phase, moment)
            )
            for moment in moments
        )

    def accepting_throughout(
        self, phase: str, start: float, end: float, grace_s: float
    ) -> list[str]:
        """The engines serving `phase` in [start, end] that were never down (nor in grace)
        then."""
        return [
            engine
            for engine in self._ever_serving(phase, start, end)
            if not any(down <= end and up + grace_s >= start for down, up in self.spans(engine))
        ]

"""When each engine of a soak did not accept connections, and which engines serve each phase.

Times are wall-clock seconds (`time.time()`), the clock of the journal's `ts`. The record
grows with the number of outages, not with the number of requests.
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
        engines = self.serving.get(phase, ())
        near = {
            engine: [
                (down, up + grace_s)
                for down, up in self.spans(engine)
                if down <= end and up + grace_s >= start
            ]
            for engine in engines
        }
        # Where the engines' down spans all overlap, the overlap begins at `start` or at the
        # start of one of them: those are the only moments worth trying.
        moments = [start] + [down for spans in near.values() for down, _ in spans if down > start]
        return any(
            all(any(down <= moment <= up for down, up in near[engine]) for engine in engines)
            for moment in moments
        )

    def accepting_throughout(
        self, phase: str, start: float, end: float, grace_s: float
    ) -> list[str]:
        """The engines serving `phase` that were never down (nor in grace) in [start, end]."""
        return [
            engine
            for engine in self.serving.get(phase, ())
            if not any(down <= end and up + grace_s >= start for down, up in self.spans(engine))
        ]

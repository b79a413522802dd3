"""Load traces: when requests arrive and how many prompt and output tokens each has.

Pure: built-in shapes are generated from a seed (the same seed, the same trace), and a
trace reads from and writes to JSONL, one request a line:

    {"arrival_s": 0.42, "prompt_tokens": 3100, "output_tokens": 64, "phase": "prefill-heavy"}

`phase` is optional (default "all"); it labels a stretch of the trace so results can be
read per phase. `tenant` is optional too (default none): the tenant whose key sends the
request, with `narwhal goodput --tenant`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

SHAPES = ("shifting", "prefill-heavy", "decode-heavy", "bursty")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    phase: str = "all"
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class Mix:
    """Uniform ranges (inclusive) of prompt and output lengths."""

    prompt: tuple[int, int]
    output: tuple[int, int]

    def draw(self, rng: random.Random, scale: float) -> tuple[int, int]:
        return _draw(rng, self.prompt, scale), _draw(rng, self.output, scale)

    def scaled(self, scale: float) -> Mix:
        """The same mix with every length multiplied by `scale` (at least one token)."""
        return Mix(
            (max(1, round(self.prompt[0] * scale)), max(1, round(self.prompt[1] * scale))),
            (max(1, round(self.output[0] * scale)), max(1, round(self.output[1] * scale))),
        )

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt) / 2

    @property
    def mean_output(self) -> float:
        return sum(self.output) / 2


PREFILL_HEAVY = Mix(prompt=(2000, 4000), output=(50, 100))
DECODE_HEAVY = Mix(prompt=(150, 250), output=(500, 1000))
CHAT = Mix(prompt=(300, 1500), output=(100, 400))


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of a shape: its label, its length mix and its arrival rate multiplier."""

    name: str
    mix: Mix
    rate_factor: float = 1.0


def shape_phases(shape: str) -> tuple[Phase, ...]:
    """The cycle of phases a shape repeats; raises ValueError for an unknown shape."""
    if shape == "prefill-heavy":
        return (Phase("prefill-heavy", PREFILL_HEAVY),)
    if shape == "decode-heavy":
        return (Phase("decode-heavy", DECODE_HEAVY),)
    if shape == "shifting":
        return (Phase("prefill-heavy", PREFILL_HEAVY), Phase("decode-heavy", DECODE_HEAVY))
    if shape == "bursty":
        # A third of each cycle at 2.5x the rate, the rest at 0.25x: the mean is the rate.
        return (Phase("burst", CHAT, 2.5), Phase("lull", CHAT, 0.25), Phase("lull", CHAT, 0.25))
    raise ValueError(f"unknown trace shape {shape!r}; shapes: {', '.join(SHAPES)}")


def generate(
    shape: str,
    *,
    seed: int,
    duration_s: float,
    rate: float | Callable[[Mix], float],
    cycles: int = 2,
    token_scale: float = 1.0,
) -> list[TraceRequest]:
    """Poisson arrivals over `duration_s`, the shape's phases repeated `cycles` times.

    `rate` is requests per second, or a function of a phase's mix, lengths already scaled
    by `token_scale` (so a phase of long prompts can arrive more slowly than one of short
    ones, and shrunken requests arrive as much faster as they are shorter). `token_scale`
    shrinks or grows every length (small tests use small requests).
    """
    if duration_s <= 0 or cycles < 1:
        raise ValueError("a trace needs a positive duration and at least one cycle")
    rng = random.Random(seed)
    phases = shape_phases(shape) * cycles
    window = duration_s / len(phases)
    requests: list[TraceRequest] = []
    for index, phase in enumerate(phases):
        start, end = index * window, (index + 1) * window
        phase_rate = rate(phase.mix.scaled(token_scale)) if callable(rate) else rate
        phase_rate *= phase.rate_factor
        if phase_rate <= 0:
            continue
        t = start + rng.expovariate(phase_rate)
        while t < end:
            prompt, output = phase.mix.draw(rng, token_scale)
            requests.append(TraceRequest(round(t, 6), prompt, output, phase.name))
            t += rng.expovariate(phase_rate)
    return requests


def phase_runs(
    requests: Sequence[TraceRequest], duration_s: float
) -> list[tuple[str, float, float]]:
    """(phase, start, end) of each run of one phase: from its first arrival (0 for the
    first run) to the next run's, the last until `duration_s`."""
    ordered = sorted(requests, key=lambda request: request.arrival_s)
    starts: list[tuple[str, float]] = []
    for request in ordered:
        if not starts or starts[-1][0] != request.phase:
            starts.append((request.phase, request.arrival_s))
    runs = []
    for i, (phase, start) in enumerate(starts):
        start = 0.0 if i == 0 else start
        end = starts[i + 1][1] if i + 1 < len(starts) else max(duration_s, start)
        runs.append((phase, start, end))
    return runs


def phase_durations(requests: Sequence[TraceRequest], duration_s: float) -> dict[str, float]:
    """How long the trace spends in each phase (the sum of its runs)."""
    durations: dict[str, float] = {}
    for phase, start, end in phase_runs(requests, duration_s):
        durations[phase] = durations.get(phase, 0.0) + (end - start)
    return durations


def to_jsonl(requests: Sequence[TraceRequest]) -> str:
    return "".join(
        orjson.dumps(
            {
                "arrival_s": r.arrival_s,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "phase": r.phase,
                **({"tenant": r.tenant} if r.tenant else {}),
            }
        ).decode()
        + "\n"
        for r in requests
    )


def parse_jsonl(text: str) -> list[TraceRequest]:
    """Requests from JSONL text, sorted by arrival; raises ValueError naming a bad line."""
    requests = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = orjson.loads(line)
            request = TraceRequest(
                arrival_s=_number(value, "arrival_s", 0.0),
                prompt_tokens=int(_number(value, "prompt_tokens", 1)),
                output_tokens=int(_number(value, "output_tokens", 1)),
                phase=str(value.get("phase", "all")),
                tenant=str(value.get("tenant", "")),
            )
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"trace line {number}: {exc}") from None
        requests.append(request)
    return sorted(requests, key=lambda request: request.arrival_s)


def _number(value: dict[str, object], key: str, least: float) -> float:
    number = value[key]
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise ValueError(f"{key} must be a number, got {number!r}")
    if not math.isfinite(number) or number < least:
        raise ValueError(f"{key} must be at least {least}, got {number!r}")
    return float(number)


def _draw(rng: random.Random, bounds: tuple[int, int], scale: float) -> int:
    low, high = bounds
    return max(1, round(rng.randint(low, high) * scale))

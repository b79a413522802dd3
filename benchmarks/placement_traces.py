"""The placement benchmark's traces: who sends which chat, and when.

Pure: the same seed, the same trace. Three shapes:

| trace        | what repeats                                                              |
|--------------|---------------------------------------------------------------------------|
| `multi-turn` | conversations of growing length from many users: each turn resends the   |
|              |   whole conversation so far (system prompt, every question and answer)   |
| `shared`     | a few long system prompts (one of them hot) under single questions       |
| `no-reuse`   | nothing: single-turn chats with prompts of their own (the control)       |

A conversation is a `Session`: its turns go one after another (the next is sent once the
previous answer has arrived, after a think time); sessions run side by side from their
start times. The assistant's answers are part of the trace, as a client resends what it
was told.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

TRACES = ("multi-turn", "shared", "no-reuse")

_WORDS = (
    "ocean",
    "current",
    "river",
    "stone",
    "forest",
    "meadow",
    "signal",
    "vector",
    "kernel",
    "packet",
    "router",
    "engine",
    "cache",
    "prefix",
    "block",
    "token",
    "stream",
    "window",
    "buffer",
    "socket",
    "thread",
    "queue",
    "batch",
    "tensor",
    "layer",
    "matrix",
    "scalar",
    "planet",
    "comet",
    "orbit",
    "harbor",
    "bridge",
    "tunnel",
    "market",
    "garden",
    "lantern",
    "compass",
    "anchor",
    "beacon",
    "summit",
    "valley",
    "glacier",
    "canyon",
    "prairie",
    "island",
    "delta",
)


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: the messages sent, and how long the user waits before it."""

    messages: tuple[tuple[str, str], ...]
    think_s: float


@dataclass(frozen=True, slots=True)
class Session:
    """A user's turns, sent one after another from `start_s`."""

    user: str
    start_s: float
    turns: tuple[Turn, ...]


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(_WORDS) + str(rng.randrange(100))
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def multi_turn(
    seed: int = 1,
    users: int = 40,
    turns: tuple[int, int] = (5, 9),
    spread_s: float = 4.0,
) -> list[Session]:
    """Each user's conversation: a system prompt, then questions and the answers given."""
    rng = random.Random(seed)
    sessions: list[Session] = []
    for index in range(users):
        history: list[tuple[str, str]] = [("system", _text(rng, rng.randint(300, 900)))]
        steps: list[Turn] = []
        for turn in range(rng.randint(*turns)):
            history.append(("user", _text(rng, rng.randint(300, 1200))))
            steps.append(Turn(tuple(history), 0.0 if turn == 0 else rng.uniform(0.2, 0.8)))
            history.append(("assistant", _text(rng, rng.randint(200, 700))))
        sessions.append(Session(f"user-{index}", rng.uniform(0, spread_s), tuple(steps)))
    return sessions


def shared_prompts(
    seed: int = 2,
    requests: int = 200,
    prompts: int = 4,
    hot_share: float = 0.5,
    rate: float = 16.0,
) -> list[Session]:
    """Single questions under one of a few long system prompts, the first of them hot."""
    rng = random.Random(seed)
    systems = [_text(rng, rng.randint(3000, 5000)) for _ in range(prompts)]
    sessions: list[Session] = []
    at = 0.0
    for index in range(requests):
        at += rng.expovariate(rate)
        system = systems[0] if rng.random() < hot_share else rng.choice(systems[1:])
        question = _text(rng, rng.randint(200, 800))
        turn = Turn((("system", system), ("user", question)), 0.0)
        sessions.append(Session(f"asker-{index}", at, (turn,)))
    return sessions


def no_reuse(seed: int = 3, requests: int = 200, rate: float = 12.0) -> list[Session]:
    """Single-turn chats whose prompts share nothing (their first words differ)."""
    rng = random.Random(seed)
    sessions: list[Session] = []
    at = 0.0
    for index in range(requests):
        at += rng.expovariate(rate)
        system = f"request {index}: " + _text(rng, rng.randint(300, 900))
        turn = Turn((("system", system), ("user", _text(rng, rng.randint(600, 2400)))), 0.0)
        sessions.append(Session(f"solo-{index}", at, (turn,)))
    return sessions


def build(name: str, seed: int) -> list[Session]:
    """A trace by name; raises ValueError naming the traces for an unknown one."""
    if name == "multi-turn":
        return multi_turn(seed)
    if name == "shared":
        return shared_prompts(seed)
    if name == "no-reuse":
        return no_reuse(seed)
    raise ValueError(f"unknown trace {name!r}; traces: {', '.join(TRACES)}")


def request_count(sessions: Sequence[Session]) -> int:
    return sum(len(session.turns) for session in sessions)

"""Which engine of those with a seat takes a request's phase: the `[placement]` policies.

| policy   | choice among the candidates (engines of the phase with a free seat)            |
|----------|--------------------------------------------------------------------------------|
| `p2c`    | power of two choices over the load estimate (`Engine.load`)                   |
| `session`| a consistent (rendezvous) hash of the request's `user`, else of its first     |
|          |   chunk; load is not looked at (vllm-router's consistent hashing)             |
| `prefix` | among the engines within the load bound, the one expected to hold the longest |
|          |   prefix of the prompt (least loaded of equals), else power of two choices    |
|          |   among them; when no engine at all holds `min_chunks` chunks of it, `p2c`    |

The load bound is bounded-load consistent hashing's: of the last `load_window`
placements of the phase, an engine may have taken at most (1 + `load_slack`) times an
even share, so a hot prefix (a system prompt every request shares) spreads over engines
instead of piling onto one. Which engines may serve, seats, the breaker, the role rules and
the engines a request already failed on are decided before (`fleet.table`); a policy only
chooses among what is left.

Pure: no I/O and no clock; the random draws come from the caller's generator.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol, TypeVar

from narwhal.config.placement import PlacementConfig, Policy
from narwhal.engines.kv_events import CacheChange
from narwhal.fleet.prefix_index import PrefixIndex, chunk_keys, prompt_text

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block until an engine's events say otherwise (vLLM's default)."""


class Placeable(Protocol):
    @property
    def id(self) -> str: ...

    def load(self) -> float: ...


E = TypeVar("E", bound=Placeable)


@dataclass(frozen=True, slots=True)
class PromptKey:
    """What placement knows of a request's prompt: its chunk keys and its session."""

    body: Mapping[str, object]
    keys: tuple[int, ...]
    session: str | None


def p2c(candidates: Sequence[E], rng: random.Random) -> E | None:
    """Power of two choices: the less loaded of two drawn at random (the least loaded of
    one or two)."""
    if len(candidates) <= 2:
        return min(candidates, key=lambda e: e.load(), default=None)
    first, second = rng.sample(list(candidates), 2)
    return first if first.load() <= second.load() else second


def within_bound(recent: int, total: int, engines: int, slack: float) -> bool:
    """Whether an engine that took `recent` of the last `total` placements may take one
    more: at most (1 + slack) times an even share of them, counting this one."""
    return recent + 1 <= math.ceil((1 + slack) * (total + 1) / engines)


def rendezvous(candidates: Sequence[E], session: str) -> E | None:
    """The candidate with the highest hash of (session, engine): a session stays on its
    engine while it is a candidate, and moves only when it is not."""

    def weight(engine: E) -> bytes:
        return blake2b(f"{session}\x00{engine.id}".encode(), digest_size=8).digest()

    return max(candidates, key=weight, default=None)


Match = Callable[[str, PromptKey], int]


class Placer:
    """The configured policy, its prefix index and its recent placements per phase."""

    def __init__(self, config: PlacementConfig, rng: random.Random) -> None:
        self.config = config
        self.policy = config.policy
        self.index = PrefixIndex(config.index_chunks)
        # Power of two choices draws from it (a benchmark seeds it, to compare policies).
        self.rng = rng
        self._recent: dict[str, deque[str]] = {}
        # How much of a prompt an engine holds, and the least worth steering for; a
        # benchmark's oracle replaces both with an engine's exact cache.
        self.match: Match = lambda engine, key: self.index.matched(engine, key.keys)
        self.min_match = config.min_chunks
        # Placements steered by a cached prefix, and those load alone decided (by phase).
        self.steered: Counter[str] = Counter()
        self.by_load: Counter[str] = Counter()
        # Per engine: tokens per block (from its events), and evicted characters not yet
        # a whole chunk.
        self._block_size: dict[str, int] = {}
        self._evicted_chars: dict[str, float] = {}

    def key(self, body: Mapping[str, object], scope: str | None = None) -> PromptKey | None:
        """The request's key, or None under `p2c` (which never reads the prompt).

        `scope`: the LoRA adapter it runs with; an adapter's KV differs from the base
        weights' for the same text, so its chunks are keyed apart.
        """
        if self.policy is Policy.P2C:
            return None
        text = prompt_text(body)
        if text and scope is not None:
            text = f"{scope}\x1d{text}"
        keys = chunk_keys(text, self.config.chunk_chars) if text else ()
        user = body.get("user")
        return PromptKey(body, keys, user if isinstance(user, str) and user else None)

    def choose(
        self, phase: str, candidates: Sequence[E], key: PromptKey | None
    ) -> tuple[E | None, int]:
        """The engine for the phase among `candidates`, and the prefix it is expected to
        hold."""
        if key is None or self.policy is Policy.P2C or not candidates:
            return self._by_load(phase, candidates), 0
        if len(candidates) == 1:
            # Nothing to choose; what the engine is expected to hold still is journaled.
            (only,) = candidates
            self.by_load[phase] += 1
            return only, self.match(only.id, key) if self.policy is Policy.PREFIX else 0
        if self.policy is Policy.SESSION:
            session = key.session or (str(key.keys[0]) if key.keys else None)
            if session is None:
                return self._by_load(phase, candidates), 0
            return rendezvous(candidates, session), 0
        scored = [(self.match(c.id, key), c) for c in candidates]
        if max(matched for matched, _ in scored) < self.min_match:
            # Nothing worth steering for anywhere: exactly p2c.
            return self._by_load(phase, candidates), 0
        recent = Counter(self._recent.get(phase, ()))
        total = sum(recent.values())
        slack = self.config.load_slack
        eligible = [
            (matched, c)
            for matched, c in scored
            if within_bound(recent[c.id], total, len(candidates), slack)
        ] or scored
        best = max(matched for matched, _ in eligible)
        if best < self.min_match:
            # The engines holding the prefix are past the load bound: load decides among
            # the others.
            return self._by_load(phase, [c for _, c in eligible]), 0
        self.steered[phase] += 1
        return min((c for matched, c in eligible if matched == best), key=lambda e: e.load()), best

    def _by_load(self, phase: str, candidates: Sequence[E]) -> E | None:
        self.by_load[phase] += 1
        return p2c(candidates, self.rng)

    def placed(self, phase: str, engine: str, key: PromptKey | None) -> None:
        """The request's phase went to `engine`: it counts against the engine's load bound,
        and the engine will hold the prompt."""
        window = self._recent.get(phase)
        if window is None:
            window = self._recent[phase] = deque(maxlen=self.config.load_window)
        window.append(engine)
        if key is not None and key.keys and self.policy is Policy.PREFIX:
            self.index.record(engine, key.keys)

    def recent(self, phase: str) -> Counter[str]:
        """Each engine's placements among the phase's last `load_window`."""
        return Counter(self._recent.get(phase, ()))

    def cache_changed(self, engine: str, change: CacheChange) -> None:
        """An engine's own event: evicted blocks take the index's oldest chunks with them
        (about `chars_per_token` characters a token), a cleared cache all of them."""
        if change.block_size is not None:
            self._block_size[engine] = change.block_size
        if change.kind == "cleared":
            self.index.clear(engine)
            self._evicted_chars.pop(engine, None)
        elif change.kind == "removed":
            size = self._block_size.get(engine, DEFAULT_BLOCK_SIZE)
            chars = self._evicted_chars.get(engine, 0.0)
            chars += change.blocks * size * self.config.chars_per_token
            chunks = int(chars // self.config.chunk_chars)
            self._evicted_chars[engine] = chars - chunks * self.config.chunk_chars
            self.index.forget_oldest(engine, chunks)

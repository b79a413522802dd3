"""The simulated model: tokenizer, chat template and deterministic generation.

Generation is a pure function of the prompt tokens and the sampling settings, so a request
yields the same text on any engine and across a prefill/decode handoff. Each token is drawn
from the whole sequence before it, so a prompt P + G (G: tokens P generated) goes on exactly
as P would have after G, as a continued answer must.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from hashlib import blake2b
from typing import Literal

VOCAB_SIZE = 131_072
"""Token ids are in [0, VOCAB_SIZE), like a real vocabulary."""

FinishReason = Literal["stop", "length"]

_PIECE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")

_WORDS = """
the a of and to in is it that was for on are with as his they be at one have this from
or had by word but what some we can out other were all there when up use your how said
an each she which do their time if will way about many then them write would like so
these her long make thing see him two has look more day could go come did number sound
no most people my over know water than call first who may down side been now find any
new work part take get place made live where after back little only round man year came
show every good me give our under name very through just form sentence great think say
help low line differ turn cause much mean before move right boy old too same tell does
set three want air well also play small end put home read hand port large spell add even
land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father head
stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start
might story saw far sea draw left late run while press close night real life few north
whale narwhal tusk ice arctic pod dive current tide krill fjord deep cold swim
"""

VOCAB: tuple[str, ...] = tuple(f" {word}" for word in _WORDS.split())
"""Generated tokens: whole words with a leading space, so any output reads as text."""


EMPTY_TOKEN_ID = 1
"""The id of a token that detokenizes to nothing (a skipped special token)."""
EOS_TOKEN_ID = 2
"""The id of the end-of-sequence token."""


@lru_cache(maxsize=65_536)
def _piece_id(piece: str) -> int:
    digest = blake2b(piece.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB_SIZE


def tokenize(text: str) -> list[int]:
    """Split text into word/punctuation pieces (leading whitespace attached) hashed to ids."""
    return [_piece_id(piece) for piece in _PIECE.findall(text)]


def word_id(word: str) -> int:
    """The id of a generated word: the id its text tokenizes to, so text and ids agree."""
    return _piece_id(word) if word else EMPTY_TOKEN_ID


def chat_prompt(messages: Sequence[Mapping[str, object]]) -> str:
    """Render chat messages through the engine's fixed template, ending with the reply cue.

    Messages must already be validated: a string role and a string (or None) content.
    """
    parts = [
        f"<|{message['role']}|>\n{message.get('content') or ''}<|end|>\n" for message in messages
    ]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """A stable byte encoding of token ids, the input of every digest."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


@dataclass(frozen=True, slots=True)
class Sampling:
    """The settings that, with the prompt, fully determine the generated tokens."""

    temperature: float = 1.0
    seed: int = 0


class Generation:
    """One request's token stream: each `step()` produces one token and the text it releases.

    Token i is drawn from a hash of the sampling settings, the prompt tokens and the
    tokens generated before it, so it depends only on those. Greedy decoding
    (temperature 0) ignores the seed, as a real sampler would. Text that might still turn
    into a stop string is held back until it cannot. With `empty_probability`, a token
    may detokenize to nothing, like a skipped special token or part of a multi-byte
    character in a byte-level vocabulary.
    """

    __slots__ = (
        "_context",
        "_empty_threshold",
        "_eos_threshold",
        "_held",
        "_holdback",
        "_pieces",
        "_stops",
        "completion_tokens",
        "finish_reason",
        "max_tokens",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        prompt_tokens: Sequence[int],
        sampling: Sampling,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        eos_probability: float = 0.0,
        empty_probability: float = 0.0,
        weights: str | None = None,
    ) -> None:
        """`weights` names what the text is generated with beyond the base model (a LoRA
        adapter's name, say): each gives its own text for the same prompt; None is the
        base model alone."""
        # A running hash of the weights, the sampling settings and every token so far:
        # token i depends on the sequence before it and nothing else.
        context = blake2b(digest_size=16)
        if weights is not None:
            context.update(b"weights\0" + weights.encode() + b"\0")
        if sampling.temperature > 0:
            context.update(struct.pack("<qd", sampling.seed, sampling.temperature))
        context.update(token_bytes(prompt_tokens))
        self._context = context
        self.max_tokens = max_tokens
        self._stops = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._pieces: list[str] = []
        self._eos_threshold = int(eos_probability * 2**64)
        self._empty_threshold = int(empty_probability * 2**64)
        self.completion_tokens = 0
        self.finish_reason: FinishReason | None = None
        # The stop string that ended the generation (vLLM's `stop_reason`).
        self.stop_reason: str | None = None
        self.token_ids: list[int] = []

    @property
    def text(self) -> str:
        """All text released so far (the whole output once finished)."""
        return "".join(self._pieces)

    def step(self) -> str:
        """Generate the next token and return the text it releases (may be empty)."""
        state = self._context.copy().digest()
        self.completion_tokens += 1
        if int.from_bytes(state[8:], "little") < self._eos_threshold:
            self._append(EOS_TOKEN_ID)
            self.finish_reason = "stop"
            return self._release(self._held)
        word = VOCAB[int.from_bytes(state[:8], "little") % len(VOCAB)]
        if int.from_bytes(state[4:12], "little") < self._empty_threshold:
            word = ""
        self._append(word_id(word))
        if not self._stops:
            if self.completion_tokens >= self.max_tokens:
                self.finish_reason = "length"
            self._pieces.append(word)
            return word
        return self._step_with_stops(word)

    def _append(self, token: int) -> None:
        self.token_ids.append(token)
        self._context.update(struct.pack("<q", token))

    def _step_with_stops(self, word: str) -> str:
        held = self._held + word
        found = [(at, stop) for stop in self._stops if (at := held.find(stop)) >= 0]
        if found:
            cut, self.stop_reason = min(found)
            self.finish_reason = "stop"
            return self._release(held[:cut])
        if self.completion_tokens >= self.max_tokens:
            self.finish_reason = "length"
            return self._release(held)
        keep = min(self._holdback, len(held))
        self._held = held[len(held) - keep :]
        return self._release(held[: len(held) - keep])

    def _release(self, text: str) -> str:
        if self.finish_reason is not None:
            self._held = ""
        if text:
            self._pieces.append(text)
        return text

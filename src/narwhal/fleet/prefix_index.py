"""The router's picture of each engine's prefix cache: chained hashes of prompt chunks.

The router has no tokenizer, so it cuts a prompt's text into chunks of `chunk_chars`
characters instead of blocks of tokens. Chunk i's key hashes chunk i together with key
i-1, as vLLM chains its block hashes, so one key stands for everything before it and two
prompts share a key exactly when they share the text up to its chunk's end. Only whole
chunks get keys: a prompt's ragged end is never cached by an engine either.

The index keeps, per engine, the keys of the prompts placed there, least recently used
forgotten first past `capacity`. A prompt's keys are filed tail first, so the oldest of
them is its last chunk: vLLM frees a finished request's blocks in reverse order for the
same reason, and an eviction that takes a prompt's tail leaves its head (what another
prompt may share) matchable. `forget_oldest` follows an engine's own evictions (see
`narwhal.engines.kv_events`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

_SEPARATOR = "\x1e"


def prompt_text(body: Mapping[str, object]) -> str | None:
    """The text a request's prompt is cached by: a completion's prompt, a chat's messages
    (each role and text content, in order), or a Responses request's input; None when it
    has none of these.

    Token-id prompts are written as their decimal ids, so equal id prefixes still share a
    text prefix.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(token) for token in prompt)
    messages = body.get("messages")
    if "input" in body:
        return _responses_text(body)
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        parts.append(f"{message.get('role')}{_SEPARATOR}{_content(message.get('content'))}")
    return _SEPARATOR.join(parts) + _SEPARATOR


def _responses_text(body: Mapping[str, object]) -> str:
    """A Responses request's instructions, then each input item's role (or type) and text:
    a string input reads as the one user message it stands for, so that a follow-up, whose
    input is the whole conversation as items, shares its first turn's prefix."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    parts = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        parts.append(f"instructions{_SEPARATOR}{instructions}")
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, Mapping):
            continue
        role = item.get("role") or item.get("type")
        parts.append(f"{role}{_SEPARATOR}{_content(item.get('content'))}")
    return _SEPARATOR.join(parts) + _SEPARATOR


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def chunk_keys(text: str, chunk_chars: int) -> tuple[int, ...]:
    """The chained keys of the text's whole chunks, first chunk first.

    Python's own string hash (SipHash, keyed at random per process) chained through a
    tuple: about a quarter of the cost of encoding each chunk and hashing it with blake2b,
    which shows on prompts of thousands of characters. The keys mean something only
    within one process, as each router process keeps its own index.
    """
    keys: list[int] = []
    previous = 0
    for end in range(chunk_chars, len(text) + 1, chunk_chars):
        previous = hash((previous, text[end - chunk_chars : end]))
        keys.append(previous)
    return tuple(keys)


class PrefixIndex:
    """Per engine, the chunk keys it is believed to hold, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._engines: dict[str, OrderedDict[int, None]] = {}

    def matched(self, engine: str, keys: Sequence[int]) -> int:
        """How many of the leading keys the engine holds (the first missing one ends it)."""
        held = self._engines.get(engine)
        if not held:
            return 0
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def record(self, engine: str, keys: Sequence[int]) -> int:
        """The engine now holds these keys (most recently used); returns how many keys the
        engine lost to the capacity."""
        held = self._engines.setdefault(engine, OrderedDict())
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        dropped = max(0, len(held) - self.capacity)
        for _ in range(dropped):
            held.popitem(last=False)
        return dropped

    def forget_oldest(self, engine: str, count: int) -> int:
        """The engine evicted about `count` chunks: forget its least recently used ones;
        returns how many were forgotten."""
        held = self._engines.get(engine)
        if not held or count <= 0:
            return 0
        forgotten = min(count, len(held))
        for _ in range(forgotten):
            held.popitem(last=False)
        return forgotten

    def clear(self, engine: str) -> None:
        """The engine holds nothing (it cleared its cache, restarted or left)."""
        self._engines.pop(engine, None)

    def size(self, engine: str) -> int:
        held = self._engines.get(engine)
        return len(held) if held else 0

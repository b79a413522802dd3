"""Faults: what a misbehaving engine does, as validated values, and the set currently armed.

A fault is armed from the command line, the `/sim/faults` route or `SimEngine.set_fault`,
and fires on the next inference requests of its phase (`times` of them, or until cleared).
The `x-sim-fault` header applies one fault to its own request only.

On `/v1/responses` a stream has no `[DONE]` and vLLM 0.32 no error event: `close_after`
and `error_after` both cut the body after K deltas (no `response.completed`),
`done_before_token` completes the response with no output, and `silence_metadata` sends
no keep-alive comments (vLLM sends none on that route).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Literal, cast

import orjson

Phase = Literal["prefill", "decode", "any"]
"""A prefill is a request with `kv_transfer_params.do_remote_decode: true`; all else decodes."""

DescriptorFault = Literal[
    "missing_engine_id", "non_integer_block_ids", "negative_block_ids", "null"
]

_PHASES = ("prefill", "decode", "any")
_DESCRIPTORS = ("missing_engine_id", "non_integer_block_ids", "negative_block_ids", "null")


class FaultError(ValueError):
    """A fault description that cannot be armed; the message names the offending key."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One way to misbehave. Token counts (`*_after`) count generated tokens."""

    phase: Phase = "any"
    times: int | None = None  # fire on this many requests, then disarm (None: until cleared)
    status: int | None = None  # answer this HTTP error status
    hang_s: float = 0.0  # wait before the response headers
    first_token_delay_s: float = 0.0  # wait after the prompt, before the first token
    silence_after: int | None = None  # after K tokens go quiet for silence_s ...
    silence_s: float = 0.0
    silence_metadata: bool = False  # ... still sending keep-alive comments (as vLLM can)
    close_after: int | None = None  # after K tokens cut the connection, no [DONE]
    done_before_token: bool = False  # a stream sends [DONE] before any token
    error_after: int | None = None  # after K tokens an error object (or status) ...
    error_code: int = 500  # ... with this code
    descriptor: DescriptorFault | None = None  # a prefill answers this bad descriptor
    kv_pull_delay_s: float = 0.0  # a decode's KV pull is this much slower
    kv_pull_fail: bool = False  # a decode's KV pull fails
    refuse_s: float = 0.0  # drop the request and stop accepting connections this long
    crash: bool = False  # die: exit the process, or drop everything in-process
    crash_after: int | None = None  # after K tokens die, as `crash` does

    @classmethod
    def from_json(cls, value: object) -> Fault:
        """Build a fault from its JSON object, rejecting unknown keys and bad values."""
        if not isinstance(value, dict):
            raise FaultError("a fault must be a JSON object")
        checked: dict[str, object] = {}
        for key, item in value.items():
            check = _CHECKS.get(key)
            if check is None:
                raise FaultError(f"unknown fault key {key!r}")
            if not check(item):
                raise FaultError(f"fault key {key!r}: bad value {item!r}")
            checked[key] = float(item) if key.endswith("_s") else item
        if "silence_after" in checked and not checked.get("silence_s"):
            raise FaultError("fault key 'silence_after' needs a positive 'silence_s'")
        return cls(**checked)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: str | bytes) -> Fault:
        """Build a fault from JSON text (a flag value or a header)."""
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise FaultError(f"a fault must be JSON: {exc}") from exc
        return cls.from_json(value)

    def to_json(self) -> dict[str, object]:
        """The fault's JSON object, listing only the keys that differ from the defaults."""
        return {
            field.name: getattr(self, field.name)
            for field in fields(self)
            if getattr(self, field.name) != field.default
        }

    def applies_to(self, phase: Phase) -> bool:
        return self.phase in ("any", phase)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _status(value: object) -> bool:
    return _count(value) and 400 <= cast(int, value) <= 599


def _flag(value: object) -> bool:
    return isinstance(value, bool)


_CHECKS: dict[str, Callable[[object], bool]] = {
    "phase": lambda value: value in _PHASES,
    "times": lambda value: _count(value) and cast(int, value) > 0,
    "status": _status,
    "hang_s": _seconds,
    "first_token_delay_s": _seconds,
    "silence_after": _count,
    "silence_s": _seconds,
    "silence_metadata": _flag,
    "close_after": _count,
    "done_before_token": _flag,
    "error_after": _count,
    "error_code": _status,
    "descriptor": lambda value: value in _DESCRIPTORS,
    "kv_pull_delay_s": _seconds,
    "kv_pull_fail": _flag,
    "refuse_s": _seconds,
    "crash": _flag,
    "crash_after": _count,
}


@dataclass(slots=True)
class _Armed:
    fault: Fault
    remaining: int | None


class ArmedFaults:
    """The faults waiting for requests; the first one matching a request's phase fires."""

    def __init__(self, faults: Sequence[Fault] = ()) -> None:
        self._armed = [_Armed(fault, fault.times) for fault in faults]

    def replace(self, faults: Sequence[Fault]) -> None:
        self._armed = [_Armed(fault, fault.times) for fault in faults]

    def take(self, phase: Phase) -> Fault | None:
        """The fault for the next request of this phase, counting it against `times`."""
        for armed in self._armed:
            if armed.fault.applies_to(phase):
                if armed.remaining is not None:
                    armed.remaining -= 1
                    if armed.remaining == 0:
                        self._armed.remove(armed)
                return armed.fault
        return None

    def to_json(self) -> list[dict[str, object]]:
        """The armed faults, `times` showing how many firings each has left."""
        return [
            armed.fault.to_json() | ({} if armed.remaining is None else {"times": armed.remaining})
            for armed in self._armed
        ]

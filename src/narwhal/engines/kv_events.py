"""An engine's own KV cache events, as vLLM publishes them with `--kv-events-config`.

vLLM 0.32's ZMQ publisher (`"publisher": "zmq"`) sends each batch of events on a PUB
socket as three frames: the topic, an 8-byte big-endian sequence number, and the batch in
msgpack. A batch is an array `[ts, events, data_parallel_rank]`; each event is a map whose
`type` names it:

| `type`             | members read here                                               |
|--------------------|-----------------------------------------------------------------|
| `BlockStored`      | `block_hashes` (one per block), `block_size`, `medium`          |
| `BlockRemoved`     | `block_hashes`, `medium`                                        |
| `AllBlocksCleared` | none                                                            |

Only the GPU tier counts (`medium` "GPU" or absent): blocks offloaded to CPU or storage are
not what a prefill reuses. The engine must publish on an endpoint the router can reach,
e.g. `"endpoint": "tcp://*:5557"` (a wildcard binds), and the router subscribes to
`tcp://ENGINE_HOST:5557` (`[placement.kv_events]`).

`decode_batch` is pure; `KvEventFeeds` runs one subscriber per engine and hands each
change to its listener. A sequence number that starts again means a new publisher, so an
engine that restarted with an empty cache: that reads as a cleared cache. pyzmq and
msgpack come with the `kv-events` extra and are imported only when some engine's events
are configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from narwhal.runtime.background import Spawn

logger = logging.getLogger(__name__)

GPU = "GPU"
MISSING_EXTRA = (
    "[placement] kv_events needs pyzmq and msgpack: install narwhal with the kv-events "
    "extra (pip install 'narwhal[kv-events]')"
)


@dataclass(frozen=True, slots=True)
class CacheChange:
    """Blocks an engine stored or removed, or its whole cache cleared."""

    kind: Literal["stored", "removed", "cleared"]
    blocks: int = 0
    # Tokens per block, when the event says (stores do).
    block_size: int | None = None


class EventError(ValueError):
    """A message that is not a vLLM KV event batch."""


def decode_batch(payload: bytes) -> list[CacheChange]:
    """The GPU cache changes of one batch, in order; raises EventError when it is not one."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventError(f"not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventError("a batch is an array [ts, events, ...]")
    changes: list[CacheChange] = []
    for event in batch[1]:
        change = _change(event)
        if change is not None:
            changes.append(change)
    return changes


def _change(event: object) -> CacheChange | None:
    if not isinstance(event, dict):
        raise EventError(f"an event is a map, got {type(event).__name__}")
    kind = event.get("type")
    if kind == "AllBlocksCleared":
        return CacheChange("cleared")
    if kind not in ("BlockStored", "BlockRemoved"):
        return None  # a kind this version does not know
    if event.get("medium") not in (None, GPU):
        return None
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list):
        raise EventError(f"{kind} without a block_hashes list")
    if kind == "BlockRemoved":
        return CacheChange("removed", len(hashes))
    size = event.get("block_size")
    return CacheChange("stored", len(hashes), size if type(size) is int and size > 0 else None)


@dataclass(slots=True)
class FeedStats:
    """One engine's subscription, for `/narwhal/state`."""

    endpoint: str
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    # Batches lost between two received (a gap in the sequence numbers).
    missed: int = 0
    malformed: int = 0
    # Times the sequence started again (the engine restarted).
    restarts: int = 0
    last_seq: int | None = field(default=None, repr=False)

    def as_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "batches": self.batches,
            "stored_blocks": self.stored_blocks,
            "removed_blocks": self.removed_blocks,
            "cleared": self.cleared,
            "missed_batches": self.missed,
            "restarts": self.restarts,
            "malformed": self.malformed,
        }


Listener = Callable[[str, CacheChange], None]


class KvEventFeeds:
    """A subscriber per engine; each change goes to `listener(engine_id, change)`."""

    def __init__(self, endpoints: Mapping[str, str], listener: Listener) -> None:
        self.stats = {engine: FeedStats(endpoint) for engine, endpoint in endpoints.items()}
        self._listener = listener
        self._tasks: list[asyncio.Task[None]] = []
        self._context: Any = None

    def start(self, spawn: Spawn) -> None:
        """Follow every engine's feed, in tasks `spawn` starts (the router's background)."""
        if not self.stats:
            return
        try:
            import msgpack  # noqa: F401
            import zmq.asyncio
        except ImportError as exc:
            raise RuntimeError(MISSING_EXTRA) from exc
        self._context = zmq.asyncio.Context()
        for engine in self.stats:
            task = spawn(self._follow(engine), f"kv-events-{engine}")
            if task is not None:
                self._tasks.append(task)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _follow(self, engine: str) -> None:
        import zmq

        stats = self.stats[engine]
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(stats.endpoint)
        try:
            while True:
                frames = await socket.recv_multipart()
                self.receive(engine, frames)
        finally:
            socket.close(linger=0)

    def receive(self, engine: str, frames: list[bytes]) -> None:
        """One message from an engine's publisher: count it and pass its changes on."""
        stats = self.stats[engine]
        if len(frames) != 3 or len(frames[1]) != 8:
            stats.malformed += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if stats.last_seq is not None and seq > stats.last_seq + 1:
            stats.missed += seq - stats.last_seq - 1
        elif stats.last_seq is not None and seq <= stats.last_seq:
            # The numbering started again: a new publisher, so a restarted engine whose
            # cache is empty.
            stats.restarts += 1
            self._listener(engine, CacheChange("cleared"))
        stats.last_seq = seq
        try:
            changes = decode_batch(frames[2])
        except EventError as exc:
            stats.malformed += 1
            logger.warning("engine %s: malformed KV event batch: %s", engine, exc)
            return
        stats.batches += 1
        for change in changes:
            if change.kind == "stored":
                stats.stored_blocks += change.blocks
            elif change.kind == "removed":
                stats.removed_blocks += change.blocks
            else:
                stats.cleared += 1
            self._listener(engine, change)

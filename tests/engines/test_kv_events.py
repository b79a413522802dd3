"""vLLM's KV cache events: the batch format, and a subscriber over a real ZMQ socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio

from narwhal.engines.kv_events import CacheChange, EventError, KvEventFeeds, decode_batch
from narwhal.runtime.background import Background

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm" / "kv_events.json"


def test_a_batch_as_vllm_encodes_it_reads_as_gpu_changes() -> None:
    payload = bytes.fromhex(orjson.loads(DATA.read_bytes())["payload_hex"])
    # The CPU tier's store is not the GPU cache a prefill reuses.
    assert decode_batch(payload) == [
        CacheChange("stored", 2, 16),
        CacheChange("removed", 3),
        CacheChange("cleared"),
    ]


def test_what_is_not_a_batch_is_refused_by_name() -> None:
    with pytest.raises(EventError, match="not msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(EventError, match=r"a batch is an array \[ts, events, ...\]"):
        decode_batch(msgpack.packb({"ts": 1}))
    with pytest.raises(EventError, match="BlockRemoved without a block_hashes list"):
        decode_batch(msgpack.packb([1.0, [{"type": "BlockRemoved"}]]))
    # A kind this version does not know is skipped, not refused.
    assert decode_batch(msgpack.packb([1.0, [{"type": "Unknown"}]])) == []


def _batch(seq: int, *events: dict[str, object]) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgpack.packb([1.0, list(events), None])]


async def test_a_feed_follows_an_engines_publisher_and_counts_what_it_missed() -> None:
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    seen: list[tuple[str, CacheChange]] = []
    feeds = KvEventFeeds({"e0": f"tcp://127.0.0.1:{port}"}, lambda e, c: seen.append((e, c)))
    background = Background()
    await background.start()
    feeds.start(background.spawn)
    try:
        stored = {"type": "BlockStored", "block_hashes": [1, 2], "block_size": 16, "medium": "GPU"}
        # A subscriber joins a moment after it connects: publish until it hears.
        async with asyncio.timeout(30):
            while not seen:
                await publisher.send_multipart(_batch(0, stored))
                await asyncio.sleep(0.05)
        stats = feeds.stats["e0"]
        before = stats.batches
        await publisher.send_multipart(_batch(5, {"type": "BlockRemoved", "block_hashes": [1]}))
        await publisher.send_multipart([b"", b"short", b""])
        async with asyncio.timeout(30):
            while stats.batches == before or stats.malformed == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert seen[-1] == ("e0", CacheChange("removed", 1))
        assert stats.missed == 4
        assert stats.removed_blocks == 1
        assert stats.stored_blocks == 2 * before
        assert stats.as_json()["missed_batches"] == 4
    finally:
        await feeds.stop()
        await background.stop()
        publisher.close(linger=0)
        context.term()


def test_a_restarted_publisher_reads_as_a_cleared_cache() -> None:
    seen: list[CacheChange] = []
    feeds = KvEventFeeds({"e0": "tcp://127.0.0.1:1"}, lambda e, c: seen.append(c))
    removed: dict[str, object] = {"type": "BlockRemoved", "block_hashes": [1, 2]}
    feeds.receive("e0", _batch(7, removed))
    feeds.receive("e0", _batch(0, removed))
    assert seen == [CacheChange("removed", 2), CacheChange("cleared"), CacheChange("removed", 2)]
    assert feeds.stats["e0"].restarts == 1
    assert feeds.stats["e0"].missed == 0

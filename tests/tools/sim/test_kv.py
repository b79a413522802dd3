"""KV blocks: digest chains, the prefix cache, held blocks with leases, pulls over TCP."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.tools.sim.kv import (
    HeldBlocks,
    PrefixCache,
    PullError,
    SideChannel,
    block_digests,
    pull_blocks,
)


def test_digest_chain_covers_a_partial_last_block() -> None:
    assert len(block_digests(list(range(33)), 16)) == 3
    assert len(block_digests(list(range(32)), 16)) == 2


def test_a_changed_token_changes_its_block_and_every_later_one() -> None:
    tokens = list(range(48))
    changed = [*tokens[:20], 999, *tokens[21:]]
    before, after = block_digests(tokens, 16), block_digests(changed, 16)
    assert before[0] == after[0]
    assert before[1] != after[1]
    assert before[2] != after[2]


def test_prefix_cache_counts_leading_cached_blocks_and_evicts_the_oldest() -> None:
    cache = PrefixCache(capacity=3)
    digests = block_digests(list(range(64)), 16)
    cache.add(digests[:2])
    assert cache.cached_blocks(digests) == 2
    assert cache.cached_blocks(digests[1:]) == 1
    cache.add(digests[2:4])
    assert cache.cached_blocks(digests) == 0  # block 0 was evicted


async def test_held_blocks_are_freed_by_a_pull_and_cannot_be_pulled_twice() -> None:
    freed: list[int] = []
    holds = HeldBlocks(lease_s=60, free=freed.extend)
    holds.hold("req", [4, 5], [b"a", b"b"])
    with pytest.raises(PullError, match="do not match"):
        holds.take("req", [4, 6])
    assert holds.take("req", [4, 5]) == [b"a", b"b"]
    assert (freed, holds.block_count()) == ([4, 5], 0)
    with pytest.raises(PullError, match="expired or pulled"):
        holds.take("req", [4, 5])


async def test_held_blocks_are_freed_when_the_lease_ends() -> None:
    freed: list[int] = []
    holds = HeldBlocks(lease_s=0.02, free=freed.extend)
    holds.hold("req", [1, 2, 3], [b"a", b"b", b"c"])
    assert holds.block_count() == 3
    await asyncio.sleep(0.05)
    assert (freed, holds.block_count()) == ([1, 2, 3], 0)


async def test_side_channel_serves_a_pull_over_tcp_once() -> None:
    holds = HeldBlocks(lease_s=60, free=lambda blocks: None)
    digests = block_digests(list(range(20)), 16)
    holds.hold("cmpl-1", [7, 8], digests)
    channel = SideChannel(lambda: "engine-a", lambda: holds)
    port = await channel.listen("127.0.0.1", 0)
    try:
        with pytest.raises(PullError, match="unknown engine id"):
            await pull_blocks("127.0.0.1", port, "engine-b", "cmpl-1", [7, 8])
        assert await pull_blocks("127.0.0.1", port, "engine-a", "cmpl-1", [7, 8]) == digests
        with pytest.raises(PullError, match="expired or pulled"):
            await pull_blocks("127.0.0.1", port, "engine-a", "cmpl-1", [7, 8])
    finally:
        channel.abort()
    with pytest.raises(PullError, match="side channel"):
        await pull_blocks("127.0.0.1", port, "engine-a", "cmpl-1", [7, 8])

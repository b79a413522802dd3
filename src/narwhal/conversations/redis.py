"""Stored responses on a Redis server: the store that workers and replicas on several hosts
share.

Each response is one string key, `{prefix}resp:{id}`, holding a JSON header line (tenant,
model, creation time, previous id, ancestors, the input's length) followed by the input's
and the response's own bytes, with a time to live of what remains of `max_age_s`. A sorted
set, `{prefix}resp-order`, holds the ids by creation time: each put, in one script run
atomically on the server, removes from it (and deletes the keys of) the expired and the
oldest beyond `max_stored`. A conversation is read with one GET and one MGET.

The script touches keys it is not handed (those of the responses it trims), which a single
server allows and Redis Cluster does not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import orjson
import redis.asyncio as aioredis

from narwhal.conversations.record import NotStored, StoredResponse

PREFIX = "narwhal:"
# The most responses one run of the trimming script removes (and deletes the keys of).
TRIM_BATCH = 1000

# KEYS: the ids by creation time. ARGV: the expiry cutoff (created before it is expired),
# max_stored, the most to remove, the prefix of a response's key. Returns how many went.
_TRIM = """
local function trim(order, cutoff, max_stored, limit, prefix)
    local expired = redis.call('ZCOUNT', order, '-inf', '(' .. cutoff)
    local excess = redis.call('ZCARD', order) - tonumber(max_stored)
    local n = math.min(math.max(expired, excess), tonumber(limit))
    if n <= 0 then
        return 0
    end
    local ids = redis.call('ZRANGE', order, 0, n - 1)
    local keys = {}
    for i, id in ipairs(ids) do
        keys[i] = prefix .. id
    end
    redis.call('DEL', unpack(keys))
    redis.call('ZREMRANGEBYRANK', order, 0, n - 1)
    return n
end
"""
# KEYS: the response's key, the ids by creation time. ARGV: the value, its time to live in
# milliseconds, its creation time, its id, then trim's.
_PUT = (
    _TRIM
    + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
return trim(KEYS[2], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
"""
)
_PRUNE = _TRIM + "return trim(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])\n"


class RedisStore:
    """A `ConversationStore` on the Redis server `client` talks to (its connection pool is
    the store's, closed with it), under keys starting with `prefix`."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        max_stored: int,
        max_age_s: float,
        prefix: str = PREFIX,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._max_stored = max_stored
        self._max_age_s = max_age_s
        self._clock = clock
        self._keys = f"{prefix}resp:"
        self._order = f"{prefix}resp-order"
        self._put = client.register_script(_PUT)
        self._prune = client.register_script(_PRUNE)

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        max_stored: int,
        max_age_s: float,
        prefix: str = PREFIX,
        clock: Callable[[], float] = time.time,
    ) -> RedisStore:
        """The store on the server at `url`, once it has answered a PING (options in the
        URL's query, e.g. `?socket_timeout=1`, override the 5-second defaults)."""
        client = aioredis.Redis.from_url(url, socket_connect_timeout=5.0, socket_timeout=5.0)
        try:
            await client.ping()
        except BaseException:
            await client.aclose()
            raise
        return cls(client, max_stored=max_stored, max_age_s=max_age_s, prefix=prefix, clock=clock)

    async def put(self, record: StoredResponse) -> None:
        now = self._clock()
        ttl_ms = max(1, math.ceil((record.created_at + self._max_age_s - now) * 1000))
        await self._put(
            keys=[self._keys + record.id, self._order],
            args=[_encode(record), ttl_ms, repr(record.created_at), record.id, *self._trim(now)],
        )

    async def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        value = await self._client.get(self._keys + response_id)
        record = _decode(response_id, value)
        return record if self._visible(record, tenant, self._clock()) else None

    async def conversation(self, response_id: str, tenant: str | None) -> list[StoredResponse]:
        value = await self._client.get(self._keys + response_id)
        now = self._clock()
        last = _decode(response_id, value)
        if last is None or not self._visible(last, tenant, now):
            raise NotStored(response_id)
        chain = []
        if last.ancestors:
            values = await self._client.mget([self._keys + id_ for id_ in last.ancestors])
            for ancestor, found in zip(last.ancestors, values, strict=True):
                record = _decode(ancestor, found)
                if record is None or not self._visible(record, tenant, now):
                    raise NotStored(ancestor)
                chain.append(record)
        chain.append(last)
        return chain

    async def delete(self, response_id: str, tenant: str | None) -> bool:
        if await self.get(response_id, tenant) is None:
            return False
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys + response_id)
            pipe.zrem(self._order, response_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def prune(self) -> int:
        removed = 0
        while True:
            batch = int(await self._prune(keys=[self._order], args=self._trim(self._clock())))
            removed += batch
            if batch < TRIM_BATCH:
                return removed

    async def close(self) -> None:
        await self._client.aclose()

    def _trim(self, now: float) -> list[str | int]:
        """The trimming script's arguments."""
        return [repr(now - self._max_age_s), self._max_stored, TRIM_BATCH, self._keys]

    def _visible(self, record: StoredResponse | None, tenant: str | None, now: float) -> bool:
        return (
            record is not None
            and record.tenant == tenant
            and now - record.created_at <= self._max_age_s
        )


def _encode(record: StoredResponse) -> bytes:
    header = orjson.dumps(
        {
            "tenant": record.tenant,
            "model": record.model,
            "created_at": record.created_at,
            "previous_id": record.previous_id,
            "ancestors": record.ancestors,
            "input_bytes": len(record.input),
        }
    )
    return b"".join((header, b"\n", record.input, record.response))


def _decode(response_id: str, value: bytes | str | None) -> StoredResponse | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError("the Redis client of a RedisStore must not decode responses")
    newline = value.index(b"\n")
    header = orjson.loads(value[:newline])
    split = newline + 1 + header["input_bytes"]
    return StoredResponse(
        id=response_id,
        tenant=header["tenant"],
        model=header["model"],
        created_at=header["created_at"],
        previous_id=header["previous_id"],
        ancestors=tuple(header["ancestors"]),
        input=value[newline + 1 : split],
        response=value[split:],
    )

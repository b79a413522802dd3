"""KV blocks: their content, the prefix cache, blocks held for remote pulls, and the side channel.

A block's content is a digest chain over the prompt tokens, d_i = H(d_{i-1} || block i), so a
consumer can verify that the blocks it pulled belong to the prompt it was given. The side
channel is a TCP server speaking one line of JSON each way:
``{"op": "pull", "engine_id", "request_id", "block_ids", "model"}`` →
``{"ok": true, "digests": [hex, ...], "model", "adapter"}`` or ``{"ok": false, "error": "..."}``
(with ``"model"`` when the consumer's base model is not the producer's: NIXL's compatibility
check refuses such a pair, and the blocks stay held), and
``{"op": "renew", "engine_id", "request_id"}`` → ``{"ok": true}``: a consumer's heartbeat.

Held blocks follow vLLM 0.32's NixlConnector lease (`kv_lease_duration`, 30 s by default):
a consumer that has the descriptor but is not yet pulling sends a heartbeat every sixth
of the lease, and each one moves the expiry to two thirds of a lease from then.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b

import orjson

from narwhal.tools.sim.model import token_bytes

PULL_TIMEOUT_S = 10.0
"""How long a consumer waits on a producer's side channel before failing the pull."""

SIDE_CHANNEL_BACKLOG = 2048
"""Pulls queue for the side channel as requests do for the engine's HTTP server: with
asyncio's default of 100, a producer whose event loop is busy drops connections in a burst
of pulls, and each comes back only after TCP's retransmission delay (seconds)."""

RENEWAL_SHARE = 2 / 3
"""A heartbeat keeps held blocks for this share of the lease from its arrival."""


class PullError(Exception):
    """A KV pull that failed: the consumer's failure policy decides what happens next."""


def block_digests(
    tokens: Sequence[int], block_size: int, adapter: str | None = None
) -> list[bytes]:
    """The digest chain of the prompt's blocks; the last block may be partial. Blocks
    computed under a LoRA adapter differ from the base model's (vLLM's block hashes
    take the adapter in), so the prefix cache never mixes them."""
    digests: list[bytes] = []
    previous = b"" if adapter is None else b"lora\0" + adapter.encode()
    for start in range(0, len(tokens), block_size):
        previous = blake2b(
            previous + token_bytes(tokens[start : start + block_size]), digest_size=16
        ).digest()
        digests.append(previous)
    return digests


class PrefixCache:
    """Digests of full blocks this engine computed, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._digests: OrderedDict[bytes, None] = OrderedDict()

    def cached_blocks(self, digests: Sequence[bytes]) -> int:
        """How many leading blocks are cached; a chain digest covers everything before it."""
        count = 0
        for digest in digests:
            if digest not in self._digests:
                break
            self._digests.move_to_end(digest)
            count += 1
        return count

    def peek(self, digests: Sequence[bytes]) -> int:
        """How many leading blocks are cached, leaving their recency as it is."""
        count = 0
        for digest in digests:
            if digest not in self._digests:
                break
            count += 1
        return count

    def add(self, digests: Sequence[bytes]) -> None:
        for digest in digests:
            self._digests[digest] = None
            self._digests.move_to_end(digest)
        while len(self._digests) > self._capacity:
            self._digests.popitem(last=False)


@dataclass(slots=True)
class _Hold:
    block_ids: list[int]
    digests: list[bytes]
    expiry: asyncio.TimerHandle
    expires_at: float
    adapter: str | None


class HeldBlocks:
    """Blocks a prefill keeps for a remote pull, keyed by the producer's request id.

    A hold ends when a consumer pulls it, when its lease runs out (`on_expiry` is told),
    or when the engine drops everything; each end hands the block ids back through `free`.
    """

    def __init__(
        self,
        lease_s: float,
        free: Callable[[list[int]], None],
        on_expiry: Callable[[], None] = lambda: None,
    ) -> None:
        self._lease_s = lease_s
        self._free = free
        self._on_expiry = on_expiry
        self._holds: dict[str, _Hold] = {}

    def block_count(self) -> int:
        return sum(len(hold.block_ids) for hold in self._holds.values())

    def hold(
        self,
        request_id: str,
        block_ids: list[int],
        digests: list[bytes],
        adapter: str | None = None,
    ) -> None:
        """Keep blocks computed under `adapter` (None: the base model)."""
        self._end(request_id)
        loop = asyncio.get_running_loop()
        expires_at = loop.time() + self._lease_s
        expiry = loop.call_at(expires_at, self._expire, request_id)
        self._holds[request_id] = _Hold(block_ids, digests, expiry, expires_at, adapter)

    def adapter_of(self, request_id: str) -> str | None:
        """The adapter a held request's blocks were computed with (None: base or unknown)."""
        hold = self._holds.get(request_id)
        return None if hold is None else hold.adapter

    def renew(self, request_id: str) -> None:
        """A heartbeat: keep the blocks two thirds of a lease from now, if that is later."""
        hold = self._holds.get(request_id)
        if hold is None:
            return
        loop = asyncio.get_running_loop()
        expires_at = loop.time() + self._lease_s * RENEWAL_SHARE
        if expires_at > hold.expires_at:
            hold.expiry.cancel()
            hold.expiry = loop.call_at(expires_at, self._expire, request_id)
            hold.expires_at = expires_at

    def take(self, request_id: str, block_ids: Sequence[int]) -> list[bytes]:
        """Hand the held blocks' content to a consumer and free them."""
        hold = self._holds.get(request_id)
        if hold is None:
            raise PullError(f"no blocks held for request {request_id!r} (expired or pulled)")
        if list(block_ids) != hold.block_ids:
            raise PullError(f"block ids {list(block_ids)} do not match the held blocks")
        self._end(request_id)
        return hold.digests

    def release(self, request_id: str) -> None:
        """A consumer is done with the blocks without pulling them: free them now."""
        if request_id not in self._holds:
            raise PullError(f"no blocks held for request {request_id!r} (expired or pulled)")
        self._end(request_id)

    def drop_all(self) -> None:
        for request_id in list(self._holds):
            self._end(request_id)

    def _expire(self, request_id: str) -> None:
        self._end(request_id)
        self._on_expiry()

    def _end(self, request_id: str) -> None:
        hold = self._holds.pop(request_id, None)
        if hold is not None:
            hold.expiry.cancel()
            self._free(hold.block_ids)


class SideChannel:
    """The producer's side-channel listener, serving pulls of its held blocks."""

    def __init__(
        self,
        engine_id: Callable[[], str],
        holds: Callable[[], HeldBlocks],
        model: str | None = None,
    ) -> None:
        """`model`: the base model the blocks are computed with (None: not checked)."""
        self._engine_id = engine_id
        self._holds = holds
        self._model = model
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def listen(self, host: str, port: int) -> int:
        """Start listening; returns the bound port (useful when asked for port 0)."""
        self._server = await asyncio.start_server(
            self._serve, host, port, reuse_address=True, backlog=SIDE_CHANNEL_BACKLOG
        )
        port_bound: int = self._server.sockets[0].getsockname()[1]
        return port_bound

    def abort(self) -> None:
        """Stop listening and cut every open connection, as a dying process would."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            line = await reader.readline()
            if writer.is_closing():
                return  # the engine died while the pull was on its way
            writer.write(orjson.dumps(self._answer(line)) + b"\n")
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _answer(self, line: bytes) -> dict[str, object]:
        try:
            message = orjson.loads(line)
            if not isinstance(message, dict) or message.get("op") not in (
                "pull",
                "renew",
                "release",
            ):
                raise PullError("expected a pull, a renewal or a release")
            if message.get("engine_id") != self._engine_id():
                raise PullError(f"unknown engine id {message.get('engine_id')!r}")
            request_id, block_ids = message.get("request_id"), message.get("block_ids")
            if message["op"] in ("renew", "release"):
                if not isinstance(request_id, str):
                    raise PullError(f"a {message['op']} needs a request_id string")
                if message["op"] == "renew":
                    self._holds().renew(request_id)
                else:
                    self._holds().release(request_id)
                return {"ok": True}
            if not isinstance(request_id, str) or not isinstance(block_ids, list):
                raise PullError("a pull needs a request_id string and a block_ids list")
            wanted = message.get("model")
            if self._model is not None and wanted is not None and wanted != self._model:
                return {
                    "ok": False,
                    "error": _incompatible(wanted, self._model),
                    "model": self._model,
                }
            adapter = self._holds().adapter_of(request_id)
            digests = self._holds().take(request_id, block_ids)
        except (PullError, orjson.JSONDecodeError) as exc:
            return {"ok": False, "error": str(exc)}
        return {
            "ok": True,
            "digests": [digest.hex() for digest in digests],
            "model": self._model,
            "adapter": adapter,
        }


def _incompatible(consumer: object, producer: str) -> str:
    return (
        f"NIXL compatibility hash mismatch: the decode instance serves {consumer!r}, the "
        f"prefill instance {producer!r}. Prefill and decode instances have incompatible "
        "configurations."
    )


class IncompatibleKV(PullError):
    """A producer whose blocks were computed with another base model: no transfer."""

    def __init__(self, message: str, producer_model: str | None) -> None:
        super().__init__(message)
        self.producer_model = producer_model


@dataclass(frozen=True, slots=True)
class Pulled:
    """Blocks a consumer pulled, and what the producer computed them with."""

    digests: list[bytes]
    model: str | None
    adapter: str | None


async def renew_lease_every(
    interval_s: float, host: str, port: int, engine_id: str, request_id: str
) -> None:
    """Send a heartbeat for held blocks every `interval_s` until cancelled; a heartbeat
    that fails is dropped (as vLLM's are), the next one tries again."""
    while True:
        await asyncio.sleep(interval_s)
        request = {"op": "renew", "engine_id": engine_id, "request_id": request_id}
        with contextlib.suppress(PullError):
            await _exchange(host, port, request)


async def release_blocks(host: str, port: int, engine_id: str, request_id: str) -> None:
    """Tell a producer its held blocks are not wanted; raises PullError on failure."""
    await _exchange(host, port, {"op": "release", "engine_id": engine_id, "request_id": request_id})


async def pull_blocks(
    host: str, port: int, engine_id: str, request_id: str, block_ids: list[int]
) -> list[bytes]:
    """Pull held blocks from a producer's side channel; raises PullError on any failure."""
    return (await pull_held(host, port, engine_id, request_id, block_ids)).digests


async def pull_held(
    host: str,
    port: int,
    engine_id: str,
    request_id: str,
    block_ids: list[int],
    model: str | None = None,
) -> Pulled:
    """Pull held blocks into an engine serving base `model`; raises PullError on any
    failure, IncompatibleKV when the producer serves another base model."""
    request = {
        "op": "pull",
        "engine_id": engine_id,
        "request_id": request_id,
        "block_ids": block_ids,
        "model": model,
    }
    answer = await _exchange(host, port, request, refusal_ok=True)
    if answer.get("ok") is not True:
        producer_model = answer.get("model")
        error = f"producer refused the pull: {answer.get('error')}"
        if isinstance(producer_model, str):
            raise IncompatibleKV(error, producer_model)
        raise PullError(error)
    digests = answer.get("digests")
    if not isinstance(digests, list):
        raise PullError("producer answered without block digests")
    try:
        pulled = [bytes.fromhex(digest) for digest in digests]
    except (TypeError, ValueError) as exc:
        raise PullError("producer answered without valid block digests") from exc
    producer_model, adapter = answer.get("model"), answer.get("adapter")
    return Pulled(
        pulled,
        producer_model if isinstance(producer_model, str) else None,
        adapter if isinstance(adapter, str) else None,
    )


async def _exchange(
    host: str, port: int, request: Mapping[str, object], *, refusal_ok: bool = False
) -> dict[str, object]:
    """One line each way with a producer's side channel; raises PullError unless it is ok
    (or, with `refusal_ok`, unless it is a JSON object)."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(PULL_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(orjson.dumps(request) + b"\n")
            answer = orjson.loads(await reader.readline())
    except (OSError, TimeoutError, orjson.JSONDecodeError) as exc:
        raise PullError(f"side channel {host}:{port} failed: {exc!r}") from exc
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    if isinstance(answer, dict) and refusal_ok:
        return answer
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise PullError(f"producer refused the pull: {error}")
    return answer

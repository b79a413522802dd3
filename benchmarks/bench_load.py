"""The router benchmark's load generator: a process of its own, driven over stdin and stdout.

It runs apart from the harness and from every target so that its parsing never shares a
process with what it measures, and it reports its own CPU so a reader can see whether it
was the bottleneck. Each stdin line is one JSON job; each answer is one JSON line on stdout.

Jobs:
- `{"job": "batch", ...}`: drive one target with concurrent clients for a fixed number of
  requests; answers a `BatchResult` as JSON.
- `{"job": "idle", ...}`: open streams that stay open, answer once each has its first token
  or has failed (or the open deadline has passed), then hold them until the next line
  arrives (any line), and answer again.
- `{"job": "tenants", ...}`: drive some tenants' load for a duration from a common start
  (`narwhal.tools.goodput.tenant_load`); answers every request's record.

The SSE parsing is deliberately minimal: split events, count those carrying generated text
(on the Responses route, its text deltas), note the time of the first one. Only the direct
path parses JSON, once, for the prefill's descriptor.
"""

from __future__ import annotations

import asyncio
import math
import re
import resource
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson
import uvloop

from narwhal.protocol.descriptor import prefill_request_params
from narwhal.tools.goodput.tenant_load import drive
from narwhal.tools.goodput.tenants import TenantLoad

PROMPT = (
    "Narwhals live in the cold waters of the Arctic, where they dive deep under the sea ice "
    "to hunt for fish and shrimp. Their long spiral tusk is a tooth that grows through the "
    "upper lip. Tell the story of one pod of narwhals over a whole year in the fjord."
)

# Generated output in a chunk: a non-empty `text` (completions) or `content` (chat).
_GENERATED = re.compile(rb'"(?:text|content)":\s*"(?!")')
_DONE = b"[DONE]"
# The Responses route's: one text delta per token, and the event that ends a stream well.
RESPONSES = "/v1/responses"
_DELTA = b"event: response.output_text.delta\n"
_COMPLETED = b"event: response.completed\n"

PREFILL_PARAMS = prefill_request_params()
"""What a prefill leg carries (the engine contract's leg 1)."""

# Inter-token gaps are kept as a log-scale histogram so that batches merge cheaply:
# 100 buckets per decade keep percentiles within about 2.3 %.
BUCKETS_PER_DECADE = 100
_SMALLEST_GAP_S = 1e-7


def gap_bucket(seconds: float) -> int:
    """The histogram bucket of one inter-token gap (0 for gaps at or under 0.1 µs)."""
    if seconds <= _SMALLEST_GAP_S:
        return 0
    return 1 + int(math.log10(seconds / _SMALLEST_GAP_S) * BUCKETS_PER_DECADE)


def bucket_seconds(bucket: int) -> float:
    """A bucket's upper edge in seconds; bucket 0 holds tokens read together, shown as 0."""
    if bucket == 0:
        return 0.0
    return float(_SMALLEST_GAP_S * 10 ** (bucket / BUCKETS_PER_DECADE))


@dataclass(frozen=True, slots=True)
class Target:
    """Where a batch goes: a router URL, or the two engines for the direct path.
    `responses`: the router is sent each request of the shape as a Responses request."""

    name: str
    url: str | None = None
    producer: str | None = None
    consumer: str | None = None
    responses: bool = False


@dataclass(slots=True)
class BatchResult:
    """What one load process measured over one batch."""

    ok: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    gaps: dict[int, int] = field(default_factory=dict)

    def add_gap(self, seconds: float) -> None:
        bucket = gap_bucket(seconds)
        self.gaps[bucket] = self.gaps.get(bucket, 0) + 1

    def fail(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(message[:300])


@dataclass(frozen=True, slots=True)
class Call:
    """One client request: its route, body, and whether it streams."""

    route: str
    body: dict[str, Any]
    stream: bool
    max_tokens: int

    def as_responses(self) -> Call:
        """The same request on the Responses route: its prompt (or last message) as the
        input, its output bound, its streaming; stored, as the route's default is."""
        body = self.body
        text = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        asked = {
            "model": body["model"],
            "input": text,
            "max_output_tokens": self.max_tokens,
            "stream": self.stream,
        }
        return Call(RESPONSES, asked, self.stream, self.max_tokens)


MIXED_TOKENS = (16, 64, 256)


def calls(shape: str, max_tokens: int, model: str, offset: int) -> Iterator[Call]:
    """The endless request sequence of a shape; `offset` shifts where a process starts in it."""
    index = offset
    while True:
        if shape == "mixed-nonstream":
            tokens = MIXED_TOKENS[index % len(MIXED_TOKENS)]
            if index % 2:
                messages = [{"role": "user", "content": PROMPT}]
                body: dict[str, Any] = {"model": model, "messages": messages}
                route = "/v1/chat/completions"
            else:
                body = {"model": model, "prompt": PROMPT}
                route = "/v1/completions"
            body.update(max_tokens=tokens, stream=False)
            yield Call(route, body, False, tokens)
        else:
            body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
            yield Call("/v1/completions", body, True, max_tokens)
        index += 1


class Client:
    """One worker's way of sending a call: through a router, or prefill then decode itself."""

    def __init__(self, session: aiohttp.ClientSession, target: Target) -> None:
        self._session = session
        self._target = target

    async def send(self, call: Call, result: BatchResult) -> None:
        started = time.perf_counter()
        headers: dict[str, str] = {}
        if self._target.url is not None:
            url, body = self._target.url + call.route, call.body
        else:
            url, body, headers = await self._prefill(call)
        async with self._session.post(
            url, data=orjson.dumps(body), headers={"Content-Type": "application/json", **headers}
        ) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status}: {text}")
            if call.stream:
                await _read_stream(response, call, started, result)
            else:
                await _read_whole(response, call, started, result)

    async def _prefill(self, call: Call) -> tuple[str, dict[str, Any], dict[str, str]]:
        """The direct path's first leg; returns the decode's URL, body and headers."""
        assert self._target.producer is not None and self._target.consumer is not None
        request_id = uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        prefill = {
            **call.body,
            "stream": False,
            "max_tokens": 1,
            "kv_transfer_params": PREFILL_PARAMS,
        }
        async with self._session.post(
            self._target.producer + call.route,
            data=orjson.dumps(prefill),
            headers={"Content-Type": "application/json", **headers},
        ) as response:
            raw = await response.read()
            if response.status != 200:
                raise RuntimeError(f"prefill HTTP {response.status}: {raw[:200]!r}")
        descriptor = orjson.loads(raw).get("kv_transfer_params")
        # The decode keeps the client's `stream`: a non-streaming client gets one answer.
        decode = {**call.body, "kv_transfer_params": descriptor}
        return self._target.consumer + call.route, decode, headers


async def _read_stream(
    response: aiohttp.ClientResponse, call: Call, started: float, result: BatchResult
) -> None:
    buffer = b""
    count = 0
    first = last = 0.0
    done = False
    responses = call.route == RESPONSES
    async for data in response.content.iter_any():
        now = time.perf_counter()
        events = (buffer + data).split(b"\n\n")
        buffer = events.pop()
        for event in events:
            if _ends(event, responses):
                done = True
            elif _is_output(event, responses):
                if count == 0:
                    first = now
                else:
                    result.add_gap(now - last)
                last = now
                count += 1
    if not done or count != call.max_tokens:
        raise RuntimeError(f"stream ended badly: {count}/{call.max_tokens} tokens, done={done}")
    result.ttft_s.append(first - started)
    if count > 1:
        result.tpot_s.append((last - first) / (count - 1))
    result.tokens += count


def _ends(event: bytes, responses: bool) -> bool:
    return event.startswith(_COMPLETED) if responses else event.endswith(_DONE)


def _is_output(event: bytes, responses: bool) -> bool:
    return event.startswith(_DELTA) if responses else _GENERATED.search(event) is not None


async def _read_whole(
    response: aiohttp.ClientResponse, call: Call, started: float, result: BatchResult
) -> None:
    answer = orjson.loads(await response.read())
    counted = "output_tokens" if call.route == RESPONSES else "completion_tokens"
    tokens = (answer.get("usage") or {}).get(counted)
    if tokens != call.max_tokens:
        raise RuntimeError(f"answer has {tokens} tokens, expected {call.max_tokens}")
    result.ttft_s.append(time.perf_counter() - started)
    result.tokens += tokens


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _session(limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=4.0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def run_batch(job: dict[str, Any]) -> BatchResult:
    """Send `requests` calls with `concurrency` clients, each waiting for its own answer."""
    target = Target(**job["target"])
    concurrency: int = job["concurrency"]
    sequence = calls(job["shape"], job["max_tokens"], job["model"], job["offset"])
    pending = iter(range(job["requests"]))
    result = BatchResult()

    async def worker(client: Client) -> None:
        for _ in pending:
            call = next(sequence)
            if target.responses:
                call = call.as_responses()
            try:
                await client.send(call, result)
            except (aiohttp.ClientError, RuntimeError, ValueError, TimeoutError) as exc:
                result.fail(f"{type(exc).__name__}: {exc}")
            else:
                result.ok += 1

    async with _session(concurrency) as session:
        client = Client(session, target)
        cpu_before, started = _cpu_s(), time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker(client))
        result.wall_s = time.perf_counter() - started
        result.cpu_s = _cpu_s() - cpu_before
    return result


async def run_idle(job: dict[str, Any], lines: asyncio.StreamReader) -> None:
    """Open `streams` streams, answer when all have a first token, hold them until told."""
    url, streams, opening = job["url"], job["streams"], job["open_concurrency"]
    opened = asyncio.Semaphore(opening)
    first_tokens: asyncio.Queue[str | None] = asyncio.Queue()
    release = asyncio.Event()
    body = orjson.dumps(
        {"model": job["model"], "prompt": PROMPT, "max_tokens": job["max_tokens"], "stream": True}
    )

    deadline = asyncio.get_running_loop().time() + job["open_timeout_s"]

    async def hold(session: aiohttp.ClientSession) -> None:
        try:
            async with opened, asyncio.timeout_at(deadline):
                response = await session.post(
                    url + "/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}")
                while not _GENERATED.search(await response.content.readuntil(b"\n\n")):
                    pass
            first_tokens.put_nowait(None)
            await release.wait()
            response.close()
        except TimeoutError:
            first_tokens.put_nowait(f"no first token within {job['open_timeout_s']:g} s")
        except (aiohttp.ClientError, RuntimeError, ValueError) as exc:
            first_tokens.put_nowait(f"{type(exc).__name__}: {exc}")

    async with _session(0) as session, asyncio.TaskGroup() as group:
        for _ in range(streams):
            group.create_task(hold(session))
        outcomes = [await first_tokens.get() for _ in range(streams)]
        errors = [outcome for outcome in outcomes if outcome is not None]
        _answer({"open": streams - len(errors), "errors": len(errors), "samples": errors[:5]})
        await lines.readline()
        release.set()
    _answer({"closed": True})


async def run_tenants(job: dict[str, Any]) -> dict[str, Any]:
    """Some tenants' load, from `start_at` for `duration_s`; every request's record."""
    cpu_before, started = _cpu_s(), time.perf_counter()
    records = await drive(
        job["url"],
        [TenantLoad.from_json(tenant) for tenant in job["tenants"]],
        duration_s=job["duration_s"],
        model=job["model"],
        seed=job["seed"],
        start_at=job["start_at"],
    )
    return {
        "records": [record.to_row() for record in records],
        "cpu_s": _cpu_s() - cpu_before,
        "wall_s": time.perf_counter() - started,
    }


def _answer(value: object) -> None:
    sys.stdout.buffer.write(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS) + b"\n")
    sys.stdout.buffer.flush()


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    lines = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(lines), sys.stdin)
    while line := await lines.readline():
        job = orjson.loads(line)
        if job["job"] == "batch":
            _answer(asdict(await run_batch(job)))
        elif job["job"] == "idle":
            await run_idle(job, lines)
        elif job["job"] == "tenants":
            _answer(await run_tenants(job))


if __name__ == "__main__":
    uvloop.run(_serve())

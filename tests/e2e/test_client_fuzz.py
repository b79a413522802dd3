"""Bad input from clients: whatever a client sends, the router answers with a clear 4xx (or a
200 for a body that is actually valid), never a 5xx, and never forwards garbage to an engine.

The fuzzed cases run against one real router over real sockets: hypothesis draws in a worker
thread and each example is sent on the stack's own event loop.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.engines.release import RELEASE_MODEL
from narwhal.protocol.descriptor import prefill_request_params
from support.stack import CHAT, COMPLETION, MODEL, Stack, StackFactory, settled

ROUTES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
FIELDS = {
    "/v1/completions": [
        "model", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
        "n", "best_of", "temperature", "top_p", "seed", "stop", "min_tokens", "echo",
        "logprobs", "suffix", "user", "kv_transfer_params",
    ],
    "/v1/chat/completions": [
        "model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
        "n", "temperature", "top_p", "seed", "stop", "min_tokens", "tools", "tool_choice",
        "response_format", "logprobs", "top_logprobs", "user", "kv_transfer_params",
    ],
}  # fmt: skip
# Engines that answer at once and stop early even when a fuzzed body drops `max_tokens`.
QUICK = {"inter_token_s": 0.0, "max_model_len": 256}
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 2**31, 2**63 - 1, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["", "\x00", "\ud800", "\U0001f40b" * 50, "x" * 200_000]),
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
messages = st.lists(
    st.one_of(
        junk,
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]) | junk},
            optional={"content": junk, "name": junk, "tool_calls": junk},
        ),
    ),
    max_size=3,
)
prompts = st.one_of(
    junk,
    st.lists(st.integers(-5, 70_000), max_size=20),
    st.lists(st.text(max_size=10), max_size=3),
    st.lists(st.lists(st.integers(-1, 300), max_size=5), max_size=3),
)


@st.composite
def fuzzed_bodies(draw: st.DrawFn, route: str) -> dict[str, Any]:
    """A valid body with a few fields replaced by junk, removed, or joined by unknown ones."""
    body = dict(ROUTES[route])
    for _ in range(draw(st.integers(1, 4))):
        field = draw(st.sampled_from(FIELDS[route]) | st.text(min_size=1, max_size=10))
        if draw(st.integers(0, 9)) == 0:
            body.pop(field, None)
        elif field == "messages":
            body[field] = draw(messages)
        elif field == "prompt":
            body[field] = draw(prompts)
        else:
            body[field] = draw(junk)
    return body


def encode(body: object) -> bytes:
    """JSON as a careless client writes it: NaN, Infinity and lone surrogates included."""
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def broken_bytes(draw: st.DrawFn, route: str) -> bytes:
    """A valid body's bytes with invalid UTF-8 spliced in, or cut short, or not JSON at all."""
    raw = encode(ROUTES[route])
    at = draw(st.integers(0, len(raw)))
    how = draw(st.sampled_from(["splice", "cut", "binary"]))
    if how == "splice":
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]))
        return raw[:at] + bad + raw[at:]
    if how == "cut":
        return raw[:at]
    return draw(st.binary(max_size=64))


def forwardable(body: Any, route: str) -> bool:
    """What the router promises engines: a JSON object of the served model that passes every
    rule the router checks (prompt or messages, positive token caps, a single sequence, a
    boolean `stream`) and carries no client-chosen `kv_transfer_params`."""
    if not isinstance(body, dict) or body.get("model") != MODEL:
        return False
    if route == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        tokens = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        if not isinstance(prompt, str) and not tokens:
            return False
    else:
        chat = body.get("messages")
        if not isinstance(chat, list) or not chat:
            return False
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in chat):
            return False
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and not (type(value) is int and value >= 1):
            return False
    if any(body.get(field) not in (None, 1) for field in ("n", "best_of")):
        return False
    if not isinstance(body.get("stream"), bool):
        return False
    params = body.get("kv_transfer_params")
    if body["stream"] is False:
        return params is None or params == prefill_request_params()
    return params is None or params.get("remote_engine_id") not in (None, "")


async def post_raw(stack: Stack, route: str, raw: bytes) -> tuple[int, Any]:
    async with stack.http.post(
        stack.url + route, data=raw, headers={"Content-Type": "application/json"}
    ) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


def check_answer(status: int, answer: Any) -> None:
    """A 200, or a 4xx carrying an OpenAI error object whose code is that status (or
    `model_not_found`, for a 404)."""
    assert status == 200 or 400 <= status < 500, (status, answer)
    if status != 200:
        error = answer["error"]
        # OpenAI names the code of an unknown model; every other error carries its status.
        code = "model_not_found" if status == 404 else status
        assert error["code"] == code and isinstance(error["message"], str) and error["message"]


def check_engines(stack: Stack, route: str) -> int:
    """Every body that reached an engine was forwardable; the count of them. The router's
    own releases of abandoned handoffs (a client gone mid-way) carry no client body."""
    received = [r for engine in stack.fleet.engines for r in engine.received]
    for request in received:
        if request.body.get("model") == RELEASE_MODEL:
            assert request.path == "/v1/completions" and request.body["kv_transfer_params"]
            continue
        assert request.path == route
        assert forwardable(request.body, route), request.body
    for engine in stack.fleet.engines:
        engine.received.clear()
    return len(received)


async def fuzz(
    stack: Stack, strategy: st.SearchStrategy[Any], send: Callable[[Any], Coroutine[Any, Any, None]]
) -> None:
    """Run hypothesis over `strategy`, each example sent on this loop by `send`."""
    loop = asyncio.get_running_loop()

    @FUZZ
    @given(strategy)
    def run(example: Any) -> None:
        asyncio.run_coroutine_threadsafe(send(example), loop).result(timeout=30)

    await asyncio.to_thread(run)


@pytest.mark.parametrize("route", ROUTES)
async def test_any_fuzzed_body_gets_a_clear_4xx_or_200_and_engines_see_only_valid_bodies(
    make_stack: StackFactory, route: str
) -> None:
    async with make_stack(sim=QUICK) as stack:
        forwarded = 0
        answered: list[int] = []

        async def send(body: dict[str, Any]) -> None:
            nonlocal forwarded
            status, answer = await post_raw(stack, route, encode(body))
            check_answer(status, answer)
            answered.append(status)
            forwarded += check_engines(stack, route)

        await fuzz(stack, fuzzed_bodies(route), send)
        await settled(stack)
        lines = await stack.journal(len(answered), kind="request")
        assert len(lines) == len(answered)
        assert all(line["status"] < 500 for line in lines)
    # Both kinds of answer happened: the fuzz reached engines and was refused before them.
    assert forwarded > 0 and 200 in answered and any(s >= 400 for s in answered)


@pytest.mark.parametrize("route", ROUTES)
async def test_bytes_that_are_not_valid_json_utf8_are_400_and_reach_no_engine(
    make_stack: StackFactory, route: str
) -> None:
    async with make_stack() as stack:

        async def send(raw: bytes) -> None:
            status, answer = await post_raw(stack, route, raw)
            check_answer(status, answer)
            assert status == 400 or raw == encode(ROUTES[route])
            assert check_engines(stack, route) == (0 if status == 400 else 2)

        await fuzz(stack, broken_bytes(route), send)
        await settled(stack)


valid_fields = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 12),
        "stream": st.booleans(),
        "temperature": st.floats(0, 2),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "n": st.just(1),
        "user": st.text(max_size=20),
        "stream_options": st.just({"include_usage": True}),
    },
)


@pytest.mark.parametrize("route", ROUTES)
async def test_a_body_that_is_actually_valid_is_answered_200(
    make_stack: StackFactory, route: str
) -> None:
    async with make_stack() as stack:

        async def send(fields: dict[str, Any]) -> None:
            body = {**ROUTES[route], **fields}
            if not body.get("stream"):
                body.pop("stream_options", None)
            status, answer = await post_raw(stack, route, encode(body))
            assert status == 200, answer
            check_engines(stack, route)

        await fuzz(stack, valid_fields, send)
        await settled(stack)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field", ["n", "best_of"])
async def test_more_than_one_sequence_is_400_before_any_engine(
    make_stack: StackFactory, route: str, field: str
) -> None:
    async with make_stack() as stack:
        status, answer = await post_raw(stack, route, encode({**ROUTES[route], field: 2}))
        assert status == 400 and f"`{field}` > 1 is not supported" in answer["error"]["message"]
        assert check_engines(stack, route) == 0


@pytest.mark.parametrize("route", ROUTES)
async def test_an_unknown_model_is_404_before_any_engine(
    make_stack: StackFactory, route: str
) -> None:
    async with make_stack() as stack:
        status, answer = await post_raw(stack, route, encode({**ROUTES[route], "model": "gpt-9"}))
        assert status == 404 and "`gpt-9` does not exist" in answer["error"]["message"]
        assert check_engines(stack, route) == 0


async def test_a_body_over_the_limit_is_413_with_or_without_a_length(
    make_stack: StackFactory,
) -> None:
    async with make_stack(serving={"max_request_bytes": 4096}) as stack:
        big = encode({**COMPLETION, "prompt": "x" * 5000})

        async def chunked() -> Any:
            for start in range(0, len(big), 1000):
                yield big[start : start + 1000]

        for data in (big, chunked()):
            async with stack.http.post(stack.url + "/v1/completions", data=data) as response:
                assert response.status == 413
                assert "4096 bytes" in (await response.json())["error"]["message"]
        assert check_engines(stack, "/v1/completions") == 0
        await settled(stack)


async def test_a_compressed_body_that_expands_past_the_limit_is_413(
    make_stack: StackFactory,
) -> None:
    async with make_stack(serving={"max_request_bytes": 65536}) as stack:
        squeeze = zlib.compressobj(wbits=31)  # gzip framing
        parts = [squeeze.compress(b'{"prompt": "')]
        parts += [squeeze.compress(b"a" * 1_000_000) for _ in range(64)]
        bomb = b"".join([*parts, squeeze.compress(b'"}'), squeeze.flush()])
        async with stack.http.post(
            stack.url + "/v1/completions", data=bomb, headers={"Content-Encoding": "gzip"}
        ) as response:
            assert response.status == 413
        assert check_engines(stack, "/v1/completions") == 0
        await settled(stack)


# Slow clients ---------------------------------------------------------------------------

SLOW = 0.5


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the router sends until it closes the connection, which must be soon."""
    return await asyncio.wait_for(reader.read(), seconds)


async def test_a_client_whose_headers_never_finish_is_disconnected(
    make_stack: StackFactory,
) -> None:
    async with make_stack(server={"client_timeout_s": SLOW}) as stack:
        reader, writer = await asyncio.open_connection(stack.server.host, stack.server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Le")
        started = asyncio.get_running_loop().time()
        for _ in range(3):  # still trickling header bytes: no excuse
            await asyncio.sleep(SLOW / 4)
            try:
                writer.write(b"n")
            except (RuntimeError, ConnectionError):
                break  # a slow machine's sleeps ran past the timeout: closed already
        assert await closed_within(reader, SLOW * 4) == b""
        assert asyncio.get_running_loop().time() - started < SLOW * 3
        writer.close()
        await settled(stack)


HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
    b"Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n{"
)


async def test_a_client_whose_body_stalls_gets_408_and_is_disconnected(
    make_stack: StackFactory,
) -> None:
    async with make_stack(server={"client_timeout_s": SLOW}) as stack:
        reader, writer = await asyncio.open_connection(stack.server.host, stack.server.port)
        writer.write(HEAD)
        answer = await closed_within(reader, SLOW * 4)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b"request body not received within 0.5 s (server.client_timeout_s)" in answer
        writer.close()
        await settled(stack)
        (line,) = await stack.journal(kind="request")
        assert line["status"] == 408 and line["cause"] == "bad_request"
        assert check_engines(stack, "/v1/completions") == 0


async def test_a_client_trickling_its_body_forever_is_disconnected(
    make_stack: StackFactory,
) -> None:
    async with make_stack(server={"client_timeout_s": SLOW}) as stack:
        reader, writer = await asyncio.open_connection(stack.server.host, stack.server.port)
        writer.write(HEAD)
        trickle = asyncio.create_task(_trickle(writer))
        started = asyncio.get_running_loop().time()
        try:
            answer = await closed_within(reader, SLOW * 4)
        except ConnectionResetError:
            answer = b""  # bytes still arriving when the router closes turn its FIN into a reset
        trickle.cancel()
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
        assert asyncio.get_running_loop().time() - started < SLOW * 3
        writer.close()
        await settled(stack)
        (line,) = await stack.journal(kind="request")
        assert line["status"] == 408


async def _trickle(writer: asyncio.StreamWriter) -> None:
    while True:
        await asyncio.sleep(SLOW / 5)
        writer.write(b" ")


async def test_an_idle_connection_is_closed_after_the_client_timeout(
    make_stack: StackFactory,
) -> None:
    async with make_stack(server={"client_timeout_s": SLOW}) as stack:
        reader, writer = await asyncio.open_connection(stack.server.host, stack.server.port)
        assert await closed_within(reader, SLOW * 4) == b""
        writer.close()


async def test_a_prompt_client_is_unaffected_by_the_client_timeout(
    make_stack: StackFactory,
) -> None:
    async with make_stack(server={"client_timeout_s": SLOW}, sim={"inter_token_s": 0.1}) as stack:
        # The stream outlasts the client timeout: it bounds reading the request only.
        body = {**COMPLETION, "stream": True, "max_tokens": 10}
        async with stack.http.post(stack.url + "/v1/completions", json=body) as response:
            text = await response.text()
        assert response.status == 200 and text.endswith("data: [DONE]\n\n")
        assert "error" not in text


async def test_a_client_that_disconnects_mid_body_is_recorded_as_499(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        _, writer = await asyncio.open_connection(stack.server.host, stack.server.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 100\r\n\r\n{"
        )
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await settled(stack)
        (line,) = await stack.journal(kind="request")
        assert line["status"] == 499 and line["outcome"] == "client_closed"

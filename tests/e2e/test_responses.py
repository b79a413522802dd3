"""The Responses API through prefill and decode, over the simulator with the `openai` client,
on both client-facing servers: conversations chained by `previous_response_id` across
consumers, the stored responses' routes, tenants' isolation, and a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from narwhal.config.root import parse_config
from narwhal.config.secrets import Secrets, load_secrets
from support.stack import MODEL, Stack, StackFactory, settled

pytestmark = pytest.mark.both_lanes

THREE_CONSUMERS = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("d2", "decode"))
TURNS = ("Tell me about whales", "And about narwhals?", "Which is larger?")


def store(tmp_path: Path) -> dict[str, Any]:
    return {"path": str(tmp_path / "responses.sqlite3")}


def text_of(response: dict[str, Any]) -> str:
    """A response object's output text, as the `openai` client's `output_text` reads it."""
    return "".join(
        part["text"]
        for item in response["output"]
        if item.get("type") == "message"
        for part in item["content"]
        if part.get("type") == "output_text"
    )


async def direct(stack: Stack, whole_input: list[Any]) -> dict[str, Any]:
    """What one engine alone answers to the whole conversation as input (no handoff)."""
    status, body = await stack.post_to_engine(
        "d0",
        "/v1/responses",
        {"model": MODEL, "input": whole_input, "max_output_tokens": 12, "store": False},
    )
    assert status == 200, body
    return dict(body)


async def drain(stack: Stack, engine: str) -> None:
    async with stack.http.post(f"{stack.url}/narwhal/engines/{engine}/drain") as response:
        assert response.status == 200, await response.text()


async def test_three_turns_each_decoded_elsewhere_equal_one_engine_fed_the_whole_input(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(THREE_CONSUMERS, responses=store(tmp_path)) as stack:
        client = stack.openai()
        whole: list[Any] = []
        previous: str | None = None
        consumers = []
        for number, text in enumerate(TURNS, 1):
            response = await client.responses.create(
                model=MODEL,
                input=text,
                max_output_tokens=12,
                previous_response_id=previous,
            )
            line = (await stack.journal(number, "request"))[-1]
            assert line["status"] == 200 and line["endpoint"] == "/v1/responses"
            assert line["handoff"] == "crossed"
            consumers.append(line["consumer"])
            whole.append({"type": "message", "role": "user", "content": text})
            alone = await direct(stack, whole)
            assert response.output_text == text_of(alone) != ""
            assert response.previous_response_id == previous
            assert response.usage is not None
            assert response.usage.input_tokens == alone["usage"]["input_tokens"]
            assert response.id == "resp_" + line["backend_request_ids"][-1]
            whole += [item.model_dump(exclude_none=True) for item in response.output]
            previous = response.id
            if number < len(TURNS):
                # The next turn must be decoded on another consumer.
                await drain(stack, line["consumer"])
        assert sorted(consumers) == ["d0", "d1", "d2"]
        await settled(stack)


async def test_a_streamed_conversation_carries_its_turns(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(THREE_CONSUMERS, responses=store(tmp_path)) as stack:
        client = stack.openai()
        whole: list[Any] = []
        previous: str | None = None
        for number, text in enumerate(TURNS, 1):
            async with client.responses.stream(
                model=MODEL, input=text, max_output_tokens=12, previous_response_id=previous
            ) as stream:
                kinds = [event.type async for event in stream]
                response = await stream.get_final_response()
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert "response.output_text.delta" in kinds
            whole.append({"type": "message", "role": "user", "content": text})
            alone = await direct(stack, whole)
            assert response.output_text == text_of(alone) != ""
            assert response.previous_response_id == previous
            line = (await stack.journal(number, "request"))[-1]
            assert line["stream"] is True and line["status"] == 200
            assert line["output_tokens"] == alone["usage"]["output_tokens"]
            whole += [item.model_dump(exclude_none=True) for item in response.output]
            previous = response.id
            if number < len(TURNS):
                await drain(stack, line["consumer"])
        # What the engines got: the whole conversation, nothing for them to store.
        bodies = [b.body for name in ("d0", "d1", "d2") for b in stack.engine(name).received]
        last = max(
            (b for b in bodies if "kv_transfer_params" in b and isinstance(b["input"], list)),
            key=lambda body: len(body["input"]),
        )
        assert last["store"] is False and "previous_response_id" not in last
        assert len(last["input"]) == 5
        assert last["input"][-1]["content"] == [{"type": "input_text", "text": TURNS[-1]}]
        await settled(stack)


async def test_stored_responses_are_read_listed_and_deleted(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(responses=store(tmp_path)) as stack:
        client = stack.openai()
        first = await client.responses.create(
            model=MODEL, max_output_tokens=12, input="Tell me about whales"
        )
        kept = await client.responses.retrieve(first.id)
        assert kept.id == first.id and kept.output_text == first.output_text
        assert (kept.model_extra or {})["store"] is True
        items = await client.responses.input_items.list(first.id)
        assert [item.type for item in items.data] == ["message"]
        assert items.data[0].model_dump(exclude_none=True)["content"] == [
            {"type": "input_text", "text": "Tell me about whales"}
        ]
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(first.id)
        error = gone.value.body
        assert isinstance(error, dict)
        assert error["param"] == "response_id"
        assert error["message"] == f"no response with id '{first.id}' is stored"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(
                model=MODEL, max_output_tokens=12, input="again", previous_response_id=first.id
            )
        assert isinstance(missing.value.body, dict)
        assert missing.value.body["param"] == "previous_response_id"
        await settled(stack)


async def test_a_response_not_stored_cannot_be_followed(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(responses=store(tmp_path)) as stack:
        client = stack.openai()
        loose = await client.responses.create(
            model=MODEL, max_output_tokens=12, input="hello", store=False
        )
        assert (loose.model_extra or {})["store"] is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(loose.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                model=MODEL, max_output_tokens=12, input="more", previous_response_id=loose.id
            )
        with pytest.raises(openai.BadRequestError) as background:
            await client.responses.create(
                model=MODEL, max_output_tokens=12, input="later", background=True
            )
        assert isinstance(background.value.body, dict)
        assert background.value.body["param"] == "background"
        await settled(stack)


async def test_with_the_store_off_a_follow_up_is_a_404(make_stack: StackFactory) -> None:
    async with make_stack(responses={"store": "off"}) as stack:
        client = stack.openai()
        answered = await client.responses.create(model=MODEL, max_output_tokens=12, input="hello")
        assert answered.output_text
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                model=MODEL, max_output_tokens=12, input="more", previous_response_id=answered.id
            )


async def test_conversations_survive_a_restart(make_stack: StackFactory, tmp_path: Path) -> None:
    async with make_stack(responses=store(tmp_path)) as stack:
        first = await stack.openai().responses.create(
            model=MODEL, input="Tell me about whales", max_output_tokens=12
        )
    async with make_stack(responses=store(tmp_path)) as stack:
        client = stack.openai()
        kept = await client.responses.retrieve(first.id)
        assert kept.output_text == first.output_text
        second = await client.responses.create(
            model=MODEL, input="And narwhals?", previous_response_id=first.id, max_output_tokens=12
        )
        (sent,) = [b.body for b in stack.engine("d0").received]
        assert [item["role"] for item in sent["input"]] == ["user", "assistant", "user"]
        assert second.previous_response_id == first.id
        await settled(stack)


KEYS = {"red": "sk-red-1111111111", "blue": "sk-blue-2222222222"}
TENANTS = [{"name": name, "api_keys": [key]} for name, key in KEYS.items()]


def tenant_secrets() -> Secrets:
    engine = {"id": "e", "url": "http://127.0.0.1:1", "role": "both"}
    read = load_secrets(parse_config({"model": "m", "engines": [engine], "tenants": TENANTS}), {})
    return Secrets(read.client_keys, (), None, read.tenant_keys)


async def test_a_tenant_sees_only_its_own_responses(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    async with make_stack(
        secrets=tenant_secrets(), tenants=TENANTS, responses=store(tmp_path)
    ) as stack:
        red, blue = (
            stack.openai(default_headers={"Authorization": f"Bearer {KEYS[name]}"})
            for name in ("red", "blue")
        )
        mine = await red.responses.create(model=MODEL, max_output_tokens=12, input="a secret")
        assert (await red.responses.retrieve(mine.id)).id == mine.id
        with pytest.raises(openai.NotFoundError):
            await blue.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            await blue.responses.input_items.list(mine.id)
        with pytest.raises(openai.NotFoundError):
            await blue.responses.create(
                model=MODEL, max_output_tokens=12, input="tell", previous_response_id=mine.id
            )
        with pytest.raises(openai.NotFoundError):
            await blue.responses.delete(mine.id)
        assert (await red.responses.retrieve(mine.id)).id == mine.id
        (line, *_) = await stack.journal(1, "request")
        assert line["tenant"] == "red"
        await settled(stack)


async def test_a_body_the_router_refuses_names_its_member(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        for body, param in (
            ({"model": MODEL}, "input"),
            ({"model": MODEL, "input": []}, "input"),
            ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
            ({"model": MODEL, "input": "x", "store": "yes"}, "store"),
        ):
            status, answer = await stack.post("/v1/responses", body)
            assert status == 400, answer
            assert answer["error"]["param"] == param, answer
        # Nothing reached an engine.
        assert not stack.engine("p0").received and not stack.engine("d0").received

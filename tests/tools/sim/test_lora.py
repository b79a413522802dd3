"""LoRA adapters on one engine: which names it serves, and vLLM 0.32's runtime-updating routes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pytest

from narwhal.tools.sim.engine import SimEngine
from narwhal.tools.sim.lora import LoraRegistry, parse_lora_module

if TYPE_CHECKING:
    from tools.sim.conftest import Sim

ADAPTERS = (("sql", "/adapters/sql"), ("poet", "/adapters/poet"))
BODY = {"prompt": "The narwhal swims under the ice", "max_tokens": 8, "temperature": 0}


async def _post_raw(
    sim: Sim, engine: SimEngine, path: str, data: bytes, content_type: str = "application/json"
) -> tuple[int, str, bytes]:
    headers = {"Content-Type": content_type}
    async with sim.session.post(engine.url + path, data=data, headers=headers) as response:
        return response.status, response.content_type, await response.read()


async def _load(sim: Sim, engine: SimEngine, body: dict[str, Any]) -> tuple[int, bytes]:
    status, _, raw = await _post_raw(sim, engine, "/v1/load_lora_adapter", orjson.dumps(body))
    return status, raw


async def _unload(sim: Sim, engine: SimEngine, body: dict[str, Any]) -> tuple[int, bytes]:
    status, _, raw = await _post_raw(sim, engine, "/v1/unload_lora_adapter", orjson.dumps(body))
    return status, raw


def _error(raw: bytes) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(raw)["error"]
    return error


def test_lora_modules_parse_as_vllm_takes_them() -> None:
    assert parse_lora_module("sql=/adapters/sql") == ("sql", "/adapters/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "m"}') == (
        "sql",
        "/a/sql",
    )
    for bad in ("sql", "=/a", "sql=", '{"name": "sql"}'):
        with pytest.raises(ValueError):
            parse_lora_module(bad)


def test_a_start_up_adapter_at_a_missing_path_stops_the_engine(tmp_path: Path) -> None:
    assert len(LoraRegistry("m", [("a", str(tmp_path))], check_paths=True)) == 1
    with pytest.raises(ValueError, match="No adapter found"):
        LoraRegistry("m", [("a", str(tmp_path / "nope"))], check_paths=True)


async def test_requests_name_the_base_or_a_loaded_adapter(sim: Sim) -> None:
    engine = await sim.start(model="base", lora_modules=ADAPTERS)
    for name in ("base", "sql", "poet"):
        status, answer = await sim.post(engine, "/v1/completions", BODY | {"model": name})
        assert status == 200
        assert answer["model"] == name  # vLLM answers with the adapter's name
    status, answer = await sim.post(engine, "/v1/completions", BODY)
    assert (status, answer["model"]) == (200, "base")


@pytest.mark.parametrize("name", ["other-base", "sq", "/adapters/sql"])
async def test_an_unknown_model_or_adapter_is_vllms_404(sim: Sim, name: str) -> None:
    engine = await sim.start(model="base", lora_modules=ADAPTERS)
    for path, body in (
        ("/v1/completions", BODY),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        status, answer = await sim.post(engine, path, body | {"model": name})
        assert status == 404
        assert answer == {
            "error": {
                "message": f"The model `{name}` does not exist. Valid aliases: base.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }


async def test_each_adapter_answers_its_own_text(sim: Sim) -> None:
    engine = await sim.start(model="base", lora_modules=ADAPTERS)
    texts = {}
    for name in ("base", "sql", "poet"):
        _, answer = await sim.post(engine, "/v1/completions", BODY | {"model": name})
        _, again = await sim.post(engine, "/v1/completions", BODY | {"model": name})
        texts[name] = answer["choices"][0]["text"]
        assert again["choices"][0]["text"] == texts[name]  # deterministic
    assert len(set(texts.values())) == 3


async def test_the_routes_are_off_unless_runtime_updating_is_on(sim: Sim) -> None:
    engine = await sim.start(model="base")
    status, _ = await _load(sim, engine, {"lora_name": "sql", "lora_path": "/a/sql"})
    assert status == 404  # not routed, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING
    status, _ = await _unload(sim, engine, {"lora_name": "sql"})
    assert status == 404


async def test_load_then_serve_then_unload(sim: Sim) -> None:
    engine = await sim.start(model="base", runtime_lora_updating=True)
    status, _, raw = await _post_raw(
        sim,
        engine,
        "/v1/load_lora_adapter",
        orjson.dumps({"lora_name": "sql", "lora_path": "/a/sql"}),
    )
    assert (status, raw) == (200, b"Success: LoRA adapter 'sql' added successfully.")
    status, answer = await sim.post(engine, "/v1/completions", BODY | {"model": "sql"})
    assert (status, answer["model"]) == (200, "sql")
    identity = orjson.loads((await sim.get(engine, "/sim/identity"))[1])
    assert identity["lora_adapters"] == {"sql": "/a/sql"}
    assert identity["runtime_lora_updating"] is True
    status, raw = await _unload(sim, engine, {"lora_name": "sql", "lora_int_id": 1})
    assert (status, raw) == (200, b"Success: LoRA adapter 'sql' removed successfully.")
    status, _ = await sim.post(engine, "/v1/completions", BODY | {"model": "sql"})
    assert status == 404
    assert [adapter.name for adapter in engine.loras] == []


async def test_load_refusals_are_vllms(sim: Sim) -> None:
    engine = await sim.start(model="base", lora_modules=ADAPTERS[:1], runtime_lora_updating=True)
    status, raw = await _load(sim, engine, {"lora_name": "sql", "lora_path": "/b/sql"})
    assert status == 400
    assert _error(raw) == {
        "message": "The lora adapter 'sql' has already been loaded. If you want to load the "
        "adapter in place, set 'load_inplace' to True.",
        "type": "InvalidUserInput",
        "param": None,
        "code": 400,
    }
    status, raw = await _load(sim, engine, {"lora_name": "base", "lora_path": "/b/x"})
    assert (status, _error(raw)["message"], _error(raw)["type"]) == (
        400,
        "The lora adapter 'base' conflicts with a served base model.",
        "InvalidUserInput",
    )
    status, raw = await _load(sim, engine, {"lora_name": "", "lora_path": "/b/x"})
    assert (status, _error(raw)["message"]) == (
        400,
        "Both 'lora_name' and 'lora_path' must be provided.",
    )
    status, _ = await _load(
        sim, engine, {"lora_name": "sql", "lora_path": "/b/sql", "load_inplace": True}
    )
    assert status == 200
    assert engine.loras.paths() == {"sql": "/b/sql"}


# Measured: vLLM 0.32's request models and validation handler behind FastAPI.
INVALID = [
    (
        "/v1/load_lora_adapter",
        b'{"lora_name": "sql"}',
        "{'type': 'missing', 'loc': 'body.lora_path', 'msg': 'Field required', "
        "'input': '<dict of 1 items>'}",
        "body.lora_path",
    ),
    (
        "/v1/unload_lora_adapter",
        b'{"lora_name": 7}',
        "{'type': 'string_type', 'loc': 'body.lora_name', 'msg': 'Input should be a valid "
        "string', 'input': '7'}",
        "body.lora_name",
    ),
    (
        "/v1/load_lora_adapter",
        b"{",
        "{'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', 'input': "
        "'<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double "
        "quotes'}}",
        "body.1",
    ),
    (
        "/v1/load_lora_adapter",
        b"[1]",
        "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid "
        "dictionary or object to extract fields from', 'input': '<list of 1 items>'}",
        "body",
    ),
    (
        "/v1/unload_lora_adapter",
        b'{"lora_name": "a", "lora_int_id": "x"}',
        "{'type': 'int_parsing', 'loc': 'body.lora_int_id', 'msg': 'Input should be a valid "
        "integer, unable to parse string as an integer', 'input': 'x'}",
        "body.lora_int_id",
    ),
    (
        "/v1/load_lora_adapter",
        b'{"lora_name": "a", "lora_path": "b", "load_inplace": null}',
        "{'type': 'bool_type', 'loc': 'body.load_inplace', 'msg': 'Input should be a valid "
        "boolean', 'input': 'None'}",
        "body.load_inplace",
    ),
]


@pytest.mark.parametrize(("path", "data", "detail", "param"), INVALID)
async def test_a_body_that_does_not_validate_is_vllms_400(
    sim: Sim, path: str, data: bytes, detail: str, param: str
) -> None:
    engine = await sim.start(model="base", runtime_lora_updating=True)
    status, _, raw = await _post_raw(sim, engine, path, data)
    assert status == 400
    assert _error(raw) == {
        "message": f"1 validation error:\n  {detail}",
        "type": "Bad Request",
        "param": param,
        "code": 400,
    }


async def test_a_body_not_sent_as_json_is_vllms_400(sim: Sim) -> None:
    engine = await sim.start(model="base", runtime_lora_updating=True)
    status, _, raw = await _post_raw(sim, engine, "/v1/load_lora_adapter", b"{}", "text/plain")
    assert status == 400
    assert _error(raw) == {
        "message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is "
        "allowed",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }


async def test_fields_are_read_leniently_as_vllm_reads_them(sim: Sim) -> None:
    engine = await sim.start(model="base", runtime_lora_updating=True)
    assert (await _load(sim, engine, {"lora_name": "a", "lora_path": "/a"}))[0] == 200
    status, _ = await _load(
        sim, engine, {"lora_name": "a", "lora_path": "/b", "load_inplace": "yes"}
    )
    assert status == 200 and engine.loras.paths() == {"a": "/b"}
    assert (await _unload(sim, engine, {"lora_name": "a", "lora_int_id": " 3 "}))[0] == 200


async def test_unloading_an_unknown_adapter_is_vllms_404(sim: Sim) -> None:
    engine = await sim.start(model="base", runtime_lora_updating=True)
    status, raw = await _unload(sim, engine, {"lora_name": "sql"})
    assert status == 404
    assert _error(raw) == {
        "message": "The lora adapter 'sql' cannot be found.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    status, raw = await _unload(sim, engine, {"lora_name": ""})
    assert (status, _error(raw)["message"]) == (
        400,
        "'lora_name' needs to be provided to unload a LoRA adapter.",
    )


async def test_a_load_from_a_missing_path_fails_as_vllm_fails(sim: Sim, tmp_path: Path) -> None:
    engine = await sim.start(model="base", runtime_lora_updating=True, check_lora_paths=True)
    status, raw = await _load(sim, engine, {"lora_name": "a", "lora_path": "/tmp/no/such"})
    assert status == 404
    assert _error(raw) == {
        # vLLM hides the path.
        "message": "Loading lora a failed: No adapter found for <path>",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    status, _ = await sim.post(engine, "/v1/completions", BODY | {"model": "a"})
    assert status == 404
    status, _ = await _load(sim, engine, {"lora_name": "a", "lora_path": str(tmp_path)})
    assert status == 200


async def test_a_restart_keeps_the_start_up_adapters_only(sim: Sim) -> None:
    engine = await sim.start(model="base", lora_modules=ADAPTERS[:1], runtime_lora_updating=True)
    await _load(sim, engine, {"lora_name": "poet", "lora_path": "/a/poet"})
    assert set(engine.loras.paths()) == {"sql", "poet"}
    await engine.restart()
    assert engine.loras.paths() == {"sql": "/adapters/sql"}

"""The adapters one engine serves over its base model, and vLLM 0.32's routes that change them.

An engine serves one base model (its served name) and any number of LoRA adapters, each a
name and a path: those given at start (`--lora-modules name=path`) and, with runtime
updating on (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), those loaded later through
`POST /v1/load_lora_adapter` and removed through `POST /v1/unload_lora_adapter`. The
answers (status, text, error bodies) are vLLM 0.32's; the sim has no weights, so a load
fails only where vLLM would fail for a missing path, and only when asked to check paths.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import orjson
from aiohttp import web

from narwhal.tools.sim.api import (
    ApiError,
    input_summary,
    invalid_field,
    lax_int,
    validation_error,
    without_paths,
)
from narwhal.tools.sim.outputs import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Adapter:
    """One loaded LoRA adapter: its served name, the path its weights came from, its id."""

    name: str
    path: str
    int_id: int


def parse_lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` item as a (name, path) pair: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"a LoRA module in JSON must be an object: {exc}") from exc
        name, path = value.get("name"), value.get("path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f'a LoRA module in JSON needs "name" and "path", got {text!r}')
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"a LoRA module is name=path, got {text!r}")
    return name, path


class LoraRegistry:
    """The adapters loaded over one base model, in the order they were loaded."""

    def __init__(
        self,
        base: str,
        modules: Sequence[tuple[str, str]] = (),
        *,
        check_paths: bool = False,
    ) -> None:
        """Load the start-up adapters; one that fails raises ValueError, as vLLM refuses
        to start."""
        self.base = base
        self._check_paths = check_paths
        self._adapters: dict[str, Adapter] = {}
        self._next_id = 0
        for name, path in modules:
            error = self._checked_load(name, path, in_place=False)
            if error is not None:
                raise ValueError(error.message)

    def __contains__(self, name: object) -> bool:
        """A loaded adapter's name (not the base model's)."""
        return name in self._adapters

    def __iter__(self) -> Iterator[Adapter]:
        return iter(self._adapters.values())

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def serves(self, name: str) -> bool:
        """The base model's name or a loaded adapter's."""
        return name == self.base or name in self._adapters

    def paths(self) -> dict[str, str]:
        return {adapter.name: adapter.path for adapter in self}

    # -- the routes ------------------------------------------------------------------------

    def load(self, raw: bytes, content_type: str) -> str:
        """`POST /v1/load_lora_adapter`: the success text, or raises ApiError."""
        body = _body(raw, content_type)
        name = _field(body, "lora_name", str, required=True)
        path = _field(body, "lora_path", str, required=True)
        in_place = _field(body, "load_inplace", bool, required=False) is True
        _field(body, "is_3d_lora_weight", bool, required=False)
        assert isinstance(name, str) and isinstance(path, str)
        error = self._checked_load(name, path, in_place=in_place)
        if error is not None:
            raise error
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, raw: bytes, content_type: str) -> str:
        """`POST /v1/unload_lora_adapter`: the success text, or raises ApiError. vLLM takes
        a `lora_int_id` too and goes by the name alone."""
        body = _body(raw, content_type)
        name = _field(body, "lora_name", str, required=True)
        _field(body, "lora_int_id", int, required=False)
        if not name:
            raise _user_error("'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in self._adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", kind="NotFoundError")
        del self._adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _checked_load(self, name: str, path: str, *, in_place: bool) -> ApiError | None:
        if not name or not path:
            return _user_error("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base:
            return _user_error(f"The lora adapter '{name}' conflicts with a served base model.")
        if not in_place and name in self._adapters:
            return _user_error(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        if self._check_paths and not os.path.exists(path):
            # vLLM's worker finds no adapter files there (and none to download): a 404.
            message = f"Loading lora {name} failed: No adapter found for {path}"
            return ApiError(404, without_paths(message), kind="NotFoundError")
        previous = self._adapters.get(name)
        if previous is not None:
            int_id = previous.int_id
        else:
            self._next_id += 1
            int_id = self._next_id
        self._adapters[name] = Adapter(name, path, int_id)
        return None


def lora_routes(loras: Callable[[], LoraRegistry]) -> list[tuple[str, str, Handler]]:
    """The runtime-updating routes over the registry `loras()` gives now. A success is a
    200 with the text alone, as vLLM answers it."""

    def route(change: Callable[[LoraRegistry, bytes, str], str]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            try:
                return web.Response(
                    text=change(loras(), raw, request.headers.get("Content-Type", ""))
                )
            except ApiError as error:
                return error_response(error)

        return handle

    return [
        ("POST", "/v1/load_lora_adapter", route(LoraRegistry.load)),
        ("POST", "/v1/unload_lora_adapter", route(LoraRegistry.unload)),
    ]


def _user_error(message: str) -> ApiError:
    return ApiError(400, message, kind="InvalidUserInput")


def _body(raw: bytes, content_type: str) -> dict[str, object]:
    """The JSON object a LoRA route takes, or vLLM's validation error (a 400)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise validation_error(
            "Unsupported Media Type: Only 'application/json' is allowed", param=None
        )
    try:
        body = json.loads(raw)
    except ValueError as exc:
        # The position and wording of Python's json module, which FastAPI parses with.
        pos = exc.pos if isinstance(exc, json.JSONDecodeError) else 0
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        invalid: dict[str, object] = {
            "type": "json_invalid",
            "loc": f"body.{pos}",
            "msg": "JSON decode error",
            "input": "<dict of 0 items>",
            "ctx": {"error": reason},
        }
        raise validation_error(str(invalid), param=f"body.{pos}") from exc
    if not isinstance(body, dict):
        error: dict[str, object] = {
            "type": "model_attributes_type",
            "loc": "body",
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": input_summary(body),
        }
        raise validation_error(str(error), param="body")
    return body


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _field(body: dict[str, object], name: str, kind: type, *, required: bool) -> object:
    """One field of a LoRA route's body, read as vLLM's request model reads it (pydantic's
    lax mode: "yes" is a boolean, "3" an integer); a field that is not there is None."""
    loc = f"body.{name}"
    if name not in body:
        if required:
            raise invalid_field("missing", loc, "Field required", body)
        return None
    value = body[name]
    if kind is str:
        if not isinstance(value, str):
            raise invalid_field("string_type", loc, "Input should be a valid string", value)
        return value
    if kind is bool:
        return _lax_bool(value, loc)
    if value is None and not required:
        return None  # an optional integer
    return lax_int(value, loc)


def _lax_bool(value: object, loc: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int | float | str):
        message = "Input should be a valid boolean, unable to interpret input"
        raise invalid_field("bool_parsing", loc, message, value)
    raise invalid_field("bool_type", loc, "Input should be a valid boolean", value)

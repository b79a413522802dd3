"""The OpenAI request bodies an engine accepts, validated into one value, and its error shapes.

Validation follows vLLM: a bad field or too long a prompt is a 400, a wrong model a 404,
unknown fields are ignored. Fields vLLM's request models read leniently (pydantic's lax
mode) are read so here too, and refused with its validation message.
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Literal

import orjson

from narwhal.tools.sim.faults import Phase
from narwhal.tools.sim.model import VOCAB_SIZE, Sampling, chat_prompt, tokenize

Route = Literal["completions", "chat"]
"""The routes whose bodies `parse_request` reads."""

Endpoint = Route | Literal["responses"]
"""Every inference route: the Responses API's body is read by `sim.responses_api`."""

PRIORITY_HEADER = "X-Vllm-Priority"
"""vLLM 0.32 reads a request's priority from this header when it holds an integer, before
the body's `priority` (`vllm/entrypoints/generate/base/serving.py`, `_get_priority`)."""

_INT64 = 2**63

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error answered to the client, with the HTTP status it has."""

    def __init__(
        self, status: int, message: str, param: str | None = None, *, kind: str | None = None
    ) -> None:
        """`kind` is the error's `type`; by default the one vLLM gives its status."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def to_json(self) -> dict[str, object]:
        """The newer vLLM error shape; `code` is the HTTP status."""
        kind = self.kind or _ERROR_TYPES.get(
            self.status, "InternalServerError" if self.status >= 500 else "BadRequestError"
        )
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }

    def body(self) -> bytes:
        return orjson.dumps(self.to_json())


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One completions, chat or Responses request, checked against the engine's limits."""

    route: Endpoint
    prompt_tokens: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    kv_transfer_params: Mapping[str, object] | None
    # `return_token_ids`: the prompt's ids once and each event's generated ids.
    return_token_ids: bool = False
    # The served name the request asked for (the base model's when it named none) and the
    # LoRA adapter that name is, if any.
    model: str = ""
    adapter: str | None = None
    # vLLM's `priority`: lower is scheduled earlier, under `--scheduling-policy priority`.
    priority: int = 0

    @property
    def is_prefill(self) -> bool:
        """A prefill leg: compute the prompt, hold its blocks for a remote decode."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))

    @property
    def is_remote_decode(self) -> bool:
        """A decode leg whose prompt blocks are pulled from a producer."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_prefill"))

    @property
    def phase(self) -> Phase:
        return "prefill" if self.is_prefill else "decode"


def parse_request(
    raw: bytes,
    route: Route,
    *,
    model: str,
    max_model_len: int,
    adapters: Container[str] = (),
    priority_header: str | None = None,
) -> InferenceRequest:
    """Validate a request body; raises ApiError (400, or 404 for a model that is neither
    the base `model` nor one of its loaded `adapters`). `priority_header` is the request's
    PRIORITY_HEADER, if it had one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    # The request model's own validation comes before any of vLLM's checks below.
    priority = request_priority(body, priority_header)
    requested_model = body.get("model")
    adapter = None
    if requested_model and requested_model != model:
        if not isinstance(requested_model, str) or requested_model not in adapters:
            raise ApiError(
                404,
                f"The model `{requested_model}` does not exist. Valid aliases: {model}.",
                "model",
            )
        adapter = requested_model
    max_tokens_field = "max_tokens"
    if route == "chat":
        prompt_tokens = tokenize(chat_prompt(_messages(body)))
        max_tokens = _optional_int(body, "max_completion_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = _optional_int(body, "max_tokens", minimum=1)
        else:
            max_tokens_field = "max_completion_tokens"
    else:
        prompt_tokens = _prompt_tokens(body)
        max_tokens = _optional_int(body, "max_tokens", minimum=1)
    if not prompt_tokens:
        raise ApiError(400, "The prompt cannot be empty.", "prompt")
    max_tokens = _bounded_max_tokens(
        max_tokens, max_tokens_field, len(prompt_tokens), max_model_len
    )
    for name in ("n", "best_of"):
        count = _optional_int(body, name, minimum=1)
        if count is not None and count > 1:
            raise ApiError(400, f"{name} > 1 is not supported by this engine.", name)
    min_tokens = _optional_int(body, "min_tokens", minimum=0) or 0
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must be <= max_tokens", "min_tokens")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    return InferenceRequest(
        route=route,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        sampling=_sampling(body),
        stop=_stop(body),
        stream=stream,
        include_usage=_include_usage(body, stream),
        kv_transfer_params=_kv_transfer_params(body),
        return_token_ids=_return_token_ids(body),
        model=adapter or model,
        adapter=adapter,
        priority=priority,
    )


def request_priority(body: dict[str, object], header: str | None = None) -> int:
    """The priority vLLM 0.32 schedules a request with: the header when it holds an integer,
    else the body's `priority` (0 when absent). The body's field is validated either way,
    as the request model validates it: an integer of 64 bits, read leniently (`"3"`, `3.0`
    and `true` are integers; `1.5`, `null` and `"x"` are refused)."""
    value = lax_int(body["priority"], "body.priority") if "priority" in body else 0
    if not -_INT64 <= value < _INT64:
        bound = ("less_than_equal", "less", "le", _INT64 - 1)
        if value < 0:
            bound = ("greater_than_equal", "greater", "ge", -_INT64)
        code, word, key, limit = bound
        message = f"Input should be {word} than or equal to {limit}"
        raise invalid_field(code, "body.priority", message, body["priority"], {key: limit})
    if header is not None:
        try:
            return int(header)
        except ValueError:
            pass  # not an integer: vLLM falls back to the body
    return value


def lax_int(value: object, loc: str) -> int:
    """An integer field read as pydantic's lax mode reads it, or its validation error."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, float):
        message = "Input should be a valid integer, got a number with a fractional part"
        raise invalid_field("int_from_float", loc, message, value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            message = "Input should be a valid integer, unable to parse string as an integer"
            raise invalid_field("int_parsing", loc, message, value) from None
    raise invalid_field("int_type", loc, "Input should be a valid integer", value)


def invalid_field(
    code: str, loc: str, message: str, value: object, ctx: dict[str, object] | None = None
) -> ApiError:
    """vLLM's 400 for one field that failed validation, `param` naming it as `body.<field>`."""
    error = {"type": code, "loc": loc, "msg": message, "input": input_summary(value)}
    if ctx is not None:
        error["ctx"] = ctx
    return validation_error(str(error), param=loc)


def input_summary(value: object) -> object:
    """How vLLM's validation message shows the offending input: containers by their size."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value if isinstance(value, str) else str(value)


def validation_error(detail: str, *, param: str | None) -> ApiError:
    """vLLM's answer to a body its request model refuses: type `Bad Request`, one error."""
    message = without_paths(f"1 validation error:\n  {detail}")
    return ApiError(400, message, param, kind="Bad Request")


_SYSTEM_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")


def without_paths(message: str) -> str:
    """vLLM 0.32 hides file-system paths in error messages: each becomes `<path>`."""
    return _FILE_PATH.sub("<path>", _SYSTEM_PATH.sub("<path>", message)).strip()


def _bounded_max_tokens(
    max_tokens: int | None, field: str, prompt_tokens: int, max_model_len: int
) -> int:
    """The output cap, as vLLM 0.32 decides it: only a cap or a prompt that alone exceeds
    the context is refused; otherwise the cap shrinks to the context left."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise ApiError(
            400,
            f"{field}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter={field}, value={max_tokens})",
            field,
        )
    if prompt_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {prompt_tokens} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={prompt_tokens})",
            "input_tokens",
        )
    left = max_model_len - prompt_tokens
    return left if max_tokens is None else min(max_tokens, left)


def _messages(body: dict[str, object]) -> list[dict[str, object]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    rendered = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a string role", "messages")
        rendered.append({"role": message["role"], "content": content_text(message.get("content"))})
    return rendered


def content_text(content: object) -> str:
    """A message's content as the chat template gets it: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        if len(parts) == len(content) and all(isinstance(text, str) for text in parts):
            return "".join(text for text in parts if isinstance(text, str))
    raise ApiError(400, "message content must be a string or a list of text parts", "messages")


def _prompt_tokens(body: dict[str, object]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and all(
        isinstance(token, int) and not isinstance(token, bool) for token in prompt
    ):
        if any(not 0 <= token < VOCAB_SIZE for token in prompt):
            raise ApiError(400, f"Token id out of vocabulary (size {VOCAB_SIZE})", "prompt")
        return list(prompt)
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt)", "prompt")


def _optional_int(body: dict[str, object], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ApiError(400, f"{name} must be an integer >= {minimum}, got {value!r}", name)
    return value


def _sampling(body: dict[str, object]) -> Sampling:
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or temperature < 0:
        raise ApiError(
            400, f"temperature must be a number >= 0, got {temperature!r}", "temperature"
        )
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError(400, f"seed must be an integer, got {seed!r}", "seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise ApiError(400, "seed must fit in 64 bits", "seed")
    return Sampling(temperature=float(temperature), seed=seed or 0)


def _stop(body: dict[str, object]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(item, str) for item in stop):
        return tuple(item for item in stop if isinstance(item, str))
    raise ApiError(400, "stop must be a string or a list of strings", "stop")


def _include_usage(body: dict[str, object], stream: bool) -> bool:
    options = body.get("stream_options")
    if not options:
        # vLLM 0.32 refuses only stream options that are set (an empty object is not).
        if options is not None and not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        return False
    if not stream:
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    include_usage = options.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise ApiError(400, "stream_options.include_usage must be a boolean", "stream_options")
    return include_usage


def _return_token_ids(body: dict[str, object]) -> bool:
    value = body.get("return_token_ids")
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, "return_token_ids must be a boolean", "return_token_ids")
    return bool(value)


def _kv_transfer_params(body: dict[str, object]) -> Mapping[str, object] | None:
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    return params

"""The Responses API's request body (`POST /v1/responses`), read as vLLM 0.32 reads it, and
its input turned into the prompt the chat route builds for the same conversation.

vLLM renders a Responses request through the chat template: `instructions` become a system
message first, a string input one user message, and input items chat messages (an
assistant's output message its first text part), so a response's text is the chat route's
text for the same conversation.

vLLM runs without `VLLM_ENABLE_RESPONSES_API_STORE` here, so nothing is ever stored:
`store` is ignored, a `previous_response_id` names no stored response (a 404) and
`background`, which needs the store, is refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

import orjson

from narwhal.tools.sim.api import (
    ApiError,
    InferenceRequest,
    content_text,
    input_summary,
    invalid_field,
    lax_int,
    request_priority,
    without_paths,
)
from narwhal.tools.sim.model import Sampling, chat_prompt, tokenize

_INT64 = 2**63
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
_STORE_NEEDED = (
    "This vLLM engine does not support `store=True` and therefore does not support the "
    "background mode. To enable these features, set the environment variable "
    "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
)


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    """One Responses request: what the engine runs, the id its response carries, and the
    request's settings a response object repeats (`echo`, by member name)."""

    inference: InferenceRequest
    request_id: str
    echo: Mapping[str, object]

    @property
    def engine_request_id(self) -> str:
        """The id the engine runs it under: vLLM's first (and here only) sub-request."""
        return f"{self.request_id}_0"


def new_request_id() -> str:
    """A request id as vLLM 0.32 makes one when the body has none: `resp_` and 16 hex."""
    return "resp_" + secrets.token_hex(8)


def parse_responses_request(
    raw: bytes,
    *,
    model: str,
    max_model_len: int,
    adapters: Container[str] = (),
    priority_header: str | None = None,
) -> ResponsesCall:
    """Validate a Responses body in vLLM 0.32's order (the request model's own checks, its
    fields, then the serving layer's model, store and prompt checks); raises ApiError.

    The `X-Request-Id` header plays no part: the response's id is the body's `request_id`.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    tool_choice = _tool_choice(body)
    if body.get("prompt") is not None:
        raise ApiError(400, "prompt template is not supported (parameter=prompt)", "prompt")
    if body.get("background") and not body.get("store", True):
        raise ApiError(
            400,
            "background can only be used when `store` is true (parameter=background)",
            "background",
        )

    # The fields, in the request model's order; the first refused one is the 400.
    background = _boolean(body, "background") or False
    items = _input(body)
    instructions = _string(body, "instructions")
    max_output_tokens = _integer(body, "max_output_tokens")
    max_tool_calls = _integer(body, "max_tool_calls")
    metadata = _mapping(body, "metadata")
    requested_model = _string(body, "model")
    parallel_tool_calls = _boolean(body, "parallel_tool_calls")
    previous_response_id = _string(body, "previous_response_id")
    store = _boolean(body, "store")
    stream = _boolean(body, "stream") or False
    temperature = _number(body, "temperature")
    top_p = _number(body, "top_p")
    user = _string(body, "user")
    presence_penalty = _number(body, "presence_penalty")
    frequency_penalty = _number(body, "frequency_penalty")
    request_id = _string(body, "request_id") or new_request_id()
    priority = request_priority(body, priority_header)
    seed = _int64(body, "seed")
    stop = _stop(body)
    kv_transfer_params = _mapping(body, "kv_transfer_params")

    # The serving layer's checks.
    adapter = None
    if requested_model and requested_model != model:
        if requested_model not in adapters:
            raise ApiError(
                404,
                f"The model `{requested_model}` does not exist. Valid aliases: {model}.",
                "model",
            )
        adapter = requested_model
    if background and store is False:  # `"false"`, say: refused as `false` is above
        raise ApiError(
            400,
            "background can only be used when `store` is true (parameter=background)",
            "background",
        )
    if background:
        raise ApiError(400, _STORE_NEEDED, "background", kind="invalid_request_error")
    if previous_response_id is not None:
        raise ApiError(
            404,
            f"Response with id '{previous_response_id}' not found.",
            "response_id",
            kind="invalid_request_error",
        )
    messages = input_messages(instructions, items)
    if continues_final(items):
        # The last message is the answer so far: generation goes on from its text, after
        # the same reply cue an answer begins with (vLLM's `continue_final_message`).
        *earlier, last = messages
        prompt_tokens = tokenize(chat_prompt(earlier)) + tokenize(str(last["content"] or ""))
    else:
        prompt_tokens = tokenize(chat_prompt(messages))
    max_tokens = _max_tokens(max_output_tokens, len(prompt_tokens), max_model_len)
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    _check_sampling(temperature, top_p)

    inference = InferenceRequest(
        route="responses",
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        sampling=Sampling(temperature=temperature, seed=seed or 0),
        stop=stop,
        stream=stream,
        include_usage=False,
        kv_transfer_params=kv_transfer_params,
        model=adapter or model,
        adapter=adapter,
        priority=priority,
    )
    tools = body.get("tools")
    echo: dict[str, object] = {
        "instructions": instructions,
        "metadata": metadata,
        "parallel_tool_calls": True if parallel_tool_calls is None else parallel_tool_calls,
        "temperature": temperature,
        "tool_choice": tool_choice,
        "tools": tools if isinstance(tools, list) else [],
        "top_p": top_p,
        "background": background,
        "max_output_tokens": max_tokens,
        "max_tool_calls": max_tool_calls,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "text": body.get("text"),
        # Only with `include: ["message.output_text.logprobs"]`, which is not simulated.
        "top_logprobs": None,
        "truncation": body.get("truncation") or "disabled",
        "user": user,
        "presence_penalty": presence_penalty or 0.0,
        "frequency_penalty": frequency_penalty or 0.0,
    }
    return ResponsesCall(inference, request_id, echo)


# -- the input, as chat messages ---------------------------------------------------------


@dataclass(slots=True)
class _Message:
    """A chat message built from input items; an assistant's may gather several items."""

    role: str
    content: str | None
    reasoning: bool = False


def continues_final(items: str | Sequence[Mapping[str, object]]) -> bool:
    """Whether the input ends with a partial assistant message, which vLLM 0.32 continues
    rather than answers: a message (or reasoning) item whose `status` is `in_progress` or
    `incomplete` (`vllm/entrypoints/openai/responses/utils.py`,
    `should_continue_final_message`)."""
    if isinstance(items, str) or not items:
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress",
        "incomplete",
    )


def input_messages(
    instructions: str | None, items: str | Sequence[Mapping[str, object]]
) -> list[dict[str, object]]:
    """The chat messages a Responses input stands for, in vLLM 0.32's way: instructions
    first as a system message, then a string input as one user message, or each item as a
    message; an assistant's reasoning, tool calls and text that follow one another make
    one assistant message."""
    messages: list[_Message] = []
    if isinstance(items, str):
        messages.append(_Message("user", items))
    else:
        for item in items:
            _add_item(messages, item)
    rendered: list[dict[str, object]] = []
    if instructions:
        rendered.append({"role": "system", "content": instructions})
    rendered += [{"role": message.role, "content": message.content} for message in messages]
    return rendered


def _add_item(messages: list[_Message], item: Mapping[str, object]) -> None:
    kind = item.get("type", "message")
    last = messages[-1] if messages and messages[-1].role == "assistant" else None
    if kind == "function_call":
        if last is None:
            messages.append(_Message("assistant", None))
    elif kind == "reasoning":
        if last is None or last.reasoning:
            messages.append(_Message("assistant", None, reasoning=True))
        else:
            last.reasoning = True
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append(_Message("tool", output if isinstance(output, str) else None))
    elif item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content)
        if last is not None and last.content is None:
            last.content = text
        else:
            messages.append(_Message("assistant", text))
    else:
        messages.append(_Message(str(item["role"]), content_text(item.get("content"))))


def _first_text(content: object) -> str:
    """An assistant output message's text: vLLM takes its first content part's."""
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else ""
    return ""


def _input(body: Mapping[str, object]) -> str | list[Mapping[str, object]]:
    """The `input` field: a string, or a list of message and tool items."""
    if "input" not in body:
        # The error shows the body as the request model saw it, its tool choice settled.
        seen = body if body.get("tools") else {**body, "tool_choice": "none"}
        raise invalid_field("missing", "body.input", "Field required", seen)
    value = body["input"]
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _validation_errors(
            [
                _error("string_type", "body.input", "Input should be a valid string", value),
                _error("list_type", "body.input", "Input should be a valid list", value),
            ],
            "body.input",
        )
    items: list[Mapping[str, object]] = []
    for index, item in enumerate(value):
        problem = _item_problem(item)
        if problem is not None:
            loc, message, offending = problem
            raise _validation_errors(
                [
                    _error("string_type", "body.input", "Input should be a valid string", value),
                    _error("invalid_item", f"body.input.{index}{loc}", message, offending),
                ],
                "body.input",
            )
        assert isinstance(item, dict)
        kind = item.get("type", "message")
        if kind not in ("message", "reasoning", "function_call", "function_call_output"):
            raise ApiError(400, f"Unsupported input item type: {kind} (parameter=input)", "input")
        items.append(item)
    return items


def _item_problem(item: object) -> tuple[str, str, object] | None:
    """Why an input item is malformed (where, what, the offending value), or None."""
    if not isinstance(item, dict):
        return "", "Input should be a valid dictionary", item
    kind = item.get("type", "message")
    if not isinstance(kind, str):
        return ".type", "Input should be a valid string", kind
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            return ".call_id", "Field required", item
        if not isinstance(item.get("output"), str | list):
            return ".output", "Input should be a valid string", item.get("output")
        return None
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                return f".{name}", "Field required", item
        return None
    if kind != "message":
        return None
    role = item.get("role")
    if role not in _ROLES:
        return ".role", "Input should be 'user', 'assistant', 'system' or 'developer'", role
    content = item.get("content")
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return ".content", "Input should be a valid string or list of content parts", content
    for index, part in enumerate(content):
        if not (
            isinstance(part, dict)
            and part.get("type") in _TEXT_PART_TYPES
            and isinstance(part.get("text"), str)
        ):
            return f".content.{index}", "Input should be a text content part", part
    return None


def _tool_choice(body: Mapping[str, object]) -> object:
    """The tool choice a response repeats: `none` without tools, as vLLM 0.32 rewrites
    `auto`; a choice that needs tools is refused without them."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if tools:
        return choice
    if choice in ("auto", "none"):
        return "none"
    if choice == "required":
        raise ApiError(
            400,
            "Tool choice 'required' must be specified with 'tools' parameter. "
            "(parameter=tool_choice)",
            "tool_choice",
        )
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        raise ApiError(
            400,
            "Tool choice 'function' not found in 'tools' parameter. (parameter=tool_choice)",
            "tool_choice",
        )
    return choice


# -- limits ------------------------------------------------------------------------------


def _max_tokens(max_output_tokens: int | None, prompt_tokens: int, max_model_len: int) -> int:
    """The output cap as vLLM 0.32 settles it for this route, with its refusals in order:
    a cap above the context, a prompt over it, a prompt that fills it, a cap below 1."""
    if max_output_tokens is not None and max_output_tokens > max_model_len:
        raise ApiError(
            400,
            f"max_output_tokens={max_output_tokens} cannot be greater than "
            f"max_model_len={max_model_len}. Please request fewer output tokens. "
            f"(parameter=max_output_tokens, value={max_output_tokens})",
            "max_output_tokens",
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
    if prompt_tokens == max_model_len:
        raise ApiError(
            400,
            f"The engine prompt length {prompt_tokens} exceeds the max_model_len "
            f"{max_model_len}. Please reduce prompt.",
            "input",
            kind="invalid_request_error",
        )
    left = max_model_len - prompt_tokens
    max_tokens = left if max_output_tokens is None else min(max_output_tokens, left)
    if max_tokens < 1:
        raise ApiError(
            400,
            f"max_tokens must be at least 1, got {max_tokens}. "
            f"(parameter=max_tokens, value={max_tokens})",
            "max_tokens",
        )
    return max_tokens


def _check_sampling(temperature: float, top_p: float) -> None:
    if not 0.0 <= temperature <= 2.0:
        if temperature < 0:
            message = f"temperature must be non-negative, got {temperature}."
        else:
            message = f"temperature must be in [0, 2], got {temperature}."
        raise ApiError(
            400, f"{message} (parameter=temperature, value={temperature})", "temperature"
        )
    if not 0.0 < top_p <= 1.0:
        raise ApiError(
            400, f"top_p must be in (0, 1], got {top_p}. (parameter=top_p, value={top_p})", "top_p"
        )


# -- fields, read as pydantic's lax mode reads them ----------------------------------------


def _string(body: Mapping[str, object], name: str) -> str | None:
    value = body.get(name)
    if value is None or isinstance(value, str):
        return value
    raise invalid_field("string_type", f"body.{name}", "Input should be a valid string", value)


def _boolean(body: Mapping[str, object], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.lower() in _TRUE_WORDS
    if isinstance(value, str | int):
        code, message = "bool_parsing", "Input should be a valid boolean, unable to interpret input"
    else:
        code, message = "bool_type", "Input should be a valid boolean"
    raise invalid_field(code, f"body.{name}", message, value)


def _number(body: Mapping[str, object], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            message = "Input should be a valid number, unable to parse string as a number"
            raise invalid_field("float_parsing", f"body.{name}", message, value) from None
    raise invalid_field("float_type", f"body.{name}", "Input should be a valid number", value)


def _integer(body: Mapping[str, object], name: str) -> int | None:
    value = body.get(name)
    return None if value is None else lax_int(value, f"body.{name}")


def _int64(body: Mapping[str, object], name: str) -> int | None:
    value = _integer(body, name)
    if value is None or -_INT64 <= value < _INT64:
        return value
    code, word, key, limit = ("less_than_equal", "less", "le", _INT64 - 1)
    if value < 0:
        code, word, key, limit = ("greater_than_equal", "greater", "ge", -_INT64)
    message = f"Input should be {word} than or equal to {limit}"
    raise invalid_field(code, f"body.{name}", message, body[name], {key: limit})


def _mapping(body: Mapping[str, object], name: str) -> dict[str, object] | None:
    value = body.get(name)
    if value is None or isinstance(value, dict):
        return value
    raise invalid_field("dict_type", f"body.{name}", "Input should be a valid dictionary", value)


def _stop(body: Mapping[str, object]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(item, str) for item in stop):
        return tuple(item for item in stop if isinstance(item, str))
    raise invalid_field("string_type", "body.stop", "Input should be a valid string", stop)


def _error(code: str, loc: str, message: str, value: object) -> dict[str, object]:
    return {"type": code, "loc": loc, "msg": message, "input": input_summary(value)}


def _validation_errors(errors: list[dict[str, object]], param: str) -> ApiError:
    """vLLM's 400 for a body its request model refuses with several errors."""
    label = "error" if len(errors) == 1 else "errors"
    lines = "".join(f"\n  {error}" for error in errors)
    message = without_paths(f"{len(errors)} validation {label}:{lines}")
    return ApiError(400, message, param, kind="Bad Request")

"""Response bodies: the SSE events of a stream and the non-streaming objects, member for
member as vLLM 0.32 serializes them (its pydantic models, in their order).

A stream's token chunks differ only in their text, so each `StreamEncoder` encodes the
fixed parts once and a token's event is three byte strings joined; vocabulary words are
pre-encoded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from narwhal.tools.sim.api import Route
from narwhal.tools.sim.model import VOCAB

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
"""What vLLM sends on an idle stream with `--sse-keep-alive-interval`: an SSE comment."""

_ENCODED_WORDS = {word: orjson.dumps(word) for word in VOCAB}


@dataclass(frozen=True, slots=True)
class Usage:
    """A request's token counts; `cached_tokens` and `reasoning_tokens` are None when the
    engine does not report them (no `--enable-prompt-tokens-details`, no reasoning parser).
    `cache_write_tokens` (prompt tokens newly written to the prefix cache) only the
    Responses API reports."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_write_tokens: int | None = None

    def streamed(self) -> dict[str, object]:
        """The usage chunk's member: vLLM leaves out what is None there."""
        usage: dict[str, object] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage

    def whole(self) -> dict[str, object]:
        """A non-streaming answer's member: every field, None as null."""
        details = None
        if self.cached_tokens is not None:
            details = {
                "cached_tokens": self.cached_tokens,
                "created_cache_tokens": None,
                "multimodal_tokens": None,
            }
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": details,
            "completion_tokens_details": (
                None
                if self.reasoning_tokens is None
                else {"reasoning_tokens": self.reasoning_tokens}
            ),
        }


def event(payload: Mapping[str, object]) -> bytes:
    """One SSE event carrying a JSON object."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


# What follows a token's text when the request asked for token ids, up to the id itself:
# the prompt's ids go on a completions stream's first chunk only.
_CHAT_IDS_AFTER = b'},"logprobs":null,"finish_reason":null,"token_ids":['
_COMPLETION_IDS_AFTER = (
    b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
    b'"prompt_token_ids":null,"token_ids":['
)


class StreamEncoder:
    """Encodes the chunks of one stream (completions or chat) exactly as vLLM 0.32 does.

    `fingerprint` is the engine's `system_fingerprint`: vLLM puts it on the usage chunk,
    or on the finishing chunk when no usage is asked for. `reasoning_field` names the
    delta member reasoning text goes in.
    """

    def __init__(
        self,
        route: Route,
        response_id: str,
        created: int,
        model: str,
        *,
        fingerprint: str,
        reasoning_field: str = "reasoning",
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self._chat = route == "chat"
        # With `return_token_ids`: the prompt's ids go on the first chunk, then each
        # chunk carries its own generated ids.
        self._prompt_ids = prompt_token_ids
        self._prompt_sent = False
        self._fingerprint = fingerprint
        self._reasoning_field = reasoning_field
        self._head = {
            "id": response_id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": created,
            "model": model,
        }
        open_head = b"data: " + orjson.dumps(self._head)[:-1] + b',"choices":[{"index":0,'
        if self._chat:
            self._before_text = open_head + b'"delta":{"content":'
            self._before_reasoning = open_head + b'"delta":{' + orjson.dumps(reasoning_field) + b":"
            self._after_text = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self._before_text = self._before_reasoning = open_head + b'"text":'
            self._after_text = (
                b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
            )

    def token(self, text: str, *, reasoning: bool = False, token_id: int = 0) -> bytes:
        """A chunk for one generated token; its text may be "" (it detokenized to nothing)."""
        encoded = _ENCODED_WORDS.get(text) or orjson.dumps(text)
        before = self._before_reasoning if reasoning else self._before_text
        if self._prompt_ids is None:
            return before + encoded + self._after_text
        if self._chat:
            after = _CHAT_IDS_AFTER
        elif self._prompt_sent:
            after = _COMPLETION_IDS_AFTER
        else:
            after = (
                b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":'
                + self._first_prompt_ids()
                + b',"token_ids":['
            )
        return before + encoded + after + b"%d]}]}\n\n" % token_id

    def _first_prompt_ids(self) -> bytes:
        """The prompt's ids the first time (a completions stream's first chunk), then null."""
        if self._prompt_ids is None or self._prompt_sent:
            return b"null"
        self._prompt_sent = True
        return orjson.dumps(self._prompt_ids)

    def last_token(
        self,
        text: str,
        finish_reason: str,
        stop_reason: str | None,
        *,
        reasoning: bool = False,
        with_fingerprint: bool,
        token_id: int = 0,
    ) -> bytes:
        """The chunk that carries the final token and the finish reason."""
        choice: dict[str, object] = {"index": 0}
        ids = None if self._prompt_ids is None else [token_id]
        if self._chat:
            choice["delta"] = {self._reasoning_field if reasoning else "content": text}
            choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason)
            choice["token_ids"] = ids
        else:
            choice.update(text=text, logprobs=None, finish_reason=finish_reason)
            prompt = orjson.Fragment(self._first_prompt_ids())
            choice.update(stop_reason=stop_reason, prompt_token_ids=prompt, token_ids=ids)
        chunk: dict[str, object] = self._head | {"choices": [choice]}
        if with_fingerprint:
            chunk["system_fingerprint"] = self._fingerprint
        return event(chunk)

    def role(self) -> bytes:
        """The chat stream's first chunk, sent with the first token, announcing the role."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        prompt = self._prompt_ids
        self._prompt_sent = True
        return event(
            self._head | {"choices": [choice], "prompt_token_ids": prompt, "prompt_text": None}
        )

    def usage(self, usage: Usage) -> bytes:
        """The last chunk before [DONE] when usage is asked for."""
        return event(
            self._head
            | {"choices": [], "usage": usage.streamed(), "system_fingerprint": self._fingerprint}
        )


@dataclass(frozen=True, slots=True)
class Answer:
    """What a finished generation says, for its non-streaming object."""

    text: str
    finish_reason: str
    stop_reason: str | None
    usage: Usage
    reasoning: str | None = None
    # With `return_token_ids`: the prompt's ids and the generated ones.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


def completion(
    route: Route,
    response_id: str,
    created: int,
    model: str,
    answer: Answer,
    *,
    fingerprint: str,
    reasoning_field: str = "reasoning",
    kv_transfer_params: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The non-streaming completions or chat object, every member vLLM 0.32 dumps."""
    choice: dict[str, object] = {"index": 0}
    top: dict[str, object] = {
        "id": response_id,
        "object": "chat.completion" if route == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": answer.usage.whole(),
    }
    if route == "chat":
        # With a reasoning parser, an answer of reasoning alone has no content.
        content = answer.text if answer.text or answer.reasoning is None else None
        choice["message"] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            reasoning_field: answer.reasoning,
        }
        choice.update(logprobs=None, finish_reason=answer.finish_reason)
        choice.update(stop_reason=answer.stop_reason, token_ids=answer.token_ids)
        choice["routed_experts"] = None
        top.update(prompt_logprobs=None, prompt_token_ids=answer.prompt_token_ids)
        top["prompt_text"] = None
    else:
        choice.update(text=answer.text, logprobs=None, finish_reason=answer.finish_reason)
        choice.update(stop_reason=answer.stop_reason, token_ids=answer.token_ids)
        choice.update(prompt_logprobs=None, prompt_token_ids=answer.prompt_token_ids)
        choice["routed_experts"] = None
    top.update(
        kv_transfer_params=None if kv_transfer_params is None else dict(kv_transfer_params),
        ec_transfer_params=None,
        metrics=None,
    )
    return top

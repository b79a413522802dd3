"""Non-streaming answers: the decode leg always streams, so the router builds the final object."""

from __future__ import annotations

from typing import Any

from narwhal.protocol.bodies import Endpoint


class Assembler:
    """Folds decode chunks into one OpenAI completion or chat completion object.

    Keeps the engine's own id, model, `finish_reason` and `usage`; concatenates text,
    content and reasoning, and merges tool-call deltas by their index.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.head: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if choice.get("stop_reason") is not None:
            self.stop_reason = choice["stop_reason"]
        if self.endpoint is Endpoint.COMPLETIONS:
            text = choice.get("text")
            if isinstance(text, str):
                self._text.append(text)
            return
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("content"), str):
            self._text.append(delta["content"])
        if isinstance(delta.get("reasoning_content"), str):
            self._reasoning.append(delta["reasoning_content"])
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                self._merge_tool_call(call)

    def _merge_tool_call(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", len(self._tool_calls))
        call = self._tool_calls.setdefault(
            index if isinstance(index, int) else 0,
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        function = delta.get("function")
        if isinstance(function, dict):
            for field in ("name", "arguments"):
                if isinstance(function.get(field), str):
                    call["function"][field] += function[field]

    def result(self) -> dict[str, Any]:
        text = "".join(self._text)
        if self.endpoint is Endpoint.COMPLETIONS:
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }
            kind = "text_completion"
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self._reasoning:
                message["reasoning_content"] = "".join(self._reasoning)
            if self._tool_calls:
                message["tool_calls"] = [self._tool_calls[i] for i in sorted(self._tool_calls)]
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }
            kind = "chat.completion"
        answer: dict[str, Any] = {"id": self.head.get("id"), "object": kind}
        answer.update({k: v for k, v in self.head.items() if k != "id"})
        answer["choices"] = [choice]
        if self.usage is not None:
            answer["usage"] = self.usage
        return answer

"""Stream continuation, the pure parts: which requests may be continued, what the client has
been given so far, the replay request, and how the rescued events are shaped for the client.

When a consumer fails after output began, the router prefills the prompt's ids P plus the
committed generated ids G on an admitted producer, decodes the remaining M - len(G) tokens on
another consumer and relays them into the same response. The I/O (placement, legs, writes)
lives in `router.rescue`; this module only decides and shapes.

What continues, decided before dispatch by `ineligible` (a request that may not be
continued ends as before: a terminal error):

| request feature                                  | continues?    | why                     |
|--------------------------------------------------|---------------|-------------------------|
| greedy (temperature 0)                           | exactly       | same ids in, same argmax |
| sampled (temperature > 0, seeded or not)         | validly       | the sampler restarts    |
| top_p/top_k/min_p, logit_bias, allowed_token_ids | yes           | per-token rules, carried |
| repetition_penalty, stop_token_ids, ignore_eos   | yes           | prompt + output counted |
| min_tokens, max_tokens, max_completion_tokens    | yes           | lowered by len(G)       |
| frequency_penalty, presence_penalty (non-zero)   | no            | count output tokens only |
| stop strings                                     | no            | held text is not in G   |
| logprobs, top_logprobs, prompt_logprobs          | no            | not replayed            |
| tools, tool_choice, functions                    | no            | tool parser state lost  |
| response_format, structured/guided output        | no            | grammar would restart   |
| echo, suffix, n > 1, best_of > 1                 | no            | (n, best_of refused)    |
| stream_options.continuous_usage_stats            | no            | per-chunk usage restarts |
| truncate_prompt_tokens, prompt_embeds, bad_words | no            | P + G handled otherwise |
| chat with a reasoning parser                     | after content | see below               |

The replay goes to /v1/completions, where no reasoning parser runs: a chat answer cut while
it was still reasoning (reasoning seen, no content yet) ends as before; this one rule is
decided at the cut, from what the stream showed, since the router cannot know the engines'
parser before dispatch.

What the client has been given so far is tracked by `router.progress`, at a cost per
event of a reference kept (and a byte splice when the ids are not the client's); the ids
are read only after a failure.

The committed boundary: generated ids can run ahead of text (a token whose bytes end inside
a UTF-8 character, text held by the detokenizer). The router keeps G as the ids up to the
last event that carried text (or finished); ids after it, whose text the client never saw,
are generated again by the replay. So nothing is lost and nothing is doubled, and no
detokenization is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from narwhal.config.continuation import ContinuationConfig
from narwhal.protocol.bodies import ClientRequest, Endpoint
from narwhal.protocol.errors import NarwhalError
from narwhal.router.call import Call
from narwhal.router.progress import Progress

# Request members carried from the client's request into the replay: the per-token rules.
_CARRIED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "priority",
    "user",
)
# Members whose mere presence (not null, not empty, not false) makes a request ineligible.
_BLOCKING = (
    ("stop", "stop strings"),
    ("logprobs", "logprobs"),
    ("top_logprobs", "logprobs"),
    ("prompt_logprobs", "prompt logprobs"),
    ("tools", "tool calls"),
    ("tool_choice", "tool calls"),
    ("functions", "tool calls"),
    ("response_format", "structured output"),
    ("structured_outputs", "structured output"),
    ("guided_json", "structured output"),
    ("guided_regex", "structured output"),
    ("guided_choice", "structured output"),
    ("guided_grammar", "structured output"),
    ("echo", "echo"),
    ("suffix", "suffix"),
    ("truncate_prompt_tokens", "prompt truncation"),
    ("prompt_embeds", "prompt embeddings"),
    ("bad_words", "bad_words"),
)


def ineligible(request: ClientRequest) -> str | None:
    """Why this request may not be continued, or None when it may (see the table above)."""
    body = request.body
    for name, reason in _BLOCKING:
        value = body.get(name)
        if value is not None and value is not False and value != [] and value != "":
            return reason
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            return name
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous usage stats"
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and value != 1:
            return name
    return None


def with_token_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body asking the engine for token ids, for a decode leg: the router
    tracks them from the decode's events (a prefill's answer is not read for them)."""
    return body if body.get("return_token_ids") is True else {**body, "return_token_ids": True}


# Why a cut answer was not continued, in kinds the journal records: the request or the
# answer as it stands cannot be (`ANSWER`), no other consumer was to be had (`FLEET`), the
# request's or the router's continuation budget was spent (`BUDGET`), or continuation is
# off (`OFF`).
ANSWER, FLEET, BUDGET, OFF = "answer", "fleet", "budget", "off"


def tracker(settings: ContinuationConfig, request: ClientRequest) -> Progress | None:
    """A tracker for a request that may be continued; None when continuation is off for it
    (`[continuation]`, or a feature that cannot continue)."""
    if not settings.enabled or settings.max_attempts == 0 or ineligible(request) is not None:
        return None
    return Progress(
        chat=request.endpoint is Endpoint.CHAT,
        strip=request.body.get("return_token_ids") is not True,
        max_tracked=settings.max_tracked_tokens,
        room=settings.max_tracked_bytes,
    )


def not_continued(call: Call, request: ClientRequest, settings: ContinuationConfig) -> None:
    """A consumer failed after output began on a request without a tracker: record why it
    was not continued (the request's features, or continuation being off)."""
    call.cut = True
    why = ineligible(request)
    if why is not None:
        call.continuation_refused, call.refused_kind = f"{why} cannot be continued", ANSWER
    elif not settings.enabled or settings.max_attempts == 0:
        call.continuation_refused, call.refused_kind = "continuation is off", OFF


class ContinuationCounts:
    """Requests continued after a consumer failed mid-answer, and cut answers that were
    not, for the fleet page and `/narwhal/state`; fed each call once it ends."""

    def __init__(self) -> None:
        self.continued = 0
        self.not_continued = 0

    def add(self, call: Call, now: float) -> None:
        if call.continuations and call.status == 200:
            self.continued += 1
        elif call.continuations or call.continuation_refused is not None:
            self.not_continued += 1


def refusal(request: ClientRequest, progress: Progress | None, max_tracked: int) -> str | None:
    """Why an answer that failed now cannot be continued (an `ANSWER` refusal), or None
    when it can. `progress` must be settled."""
    if progress is None:
        return ineligible(request) or "this request's features cannot be continued"
    if progress.overflow:
        return (
            f"the answer was longer than continuation.max_tracked_tokens ({max_tracked}) "
            "tokens (or continuation.max_tracked_bytes of events), past which the router "
            "keeps nothing to replay"
        )
    if progress.prompt_ids is None:
        return "the engine did not report the prompt's token ids"
    if request.endpoint is Endpoint.CHAT and progress.reasoning_seen and not progress.content_seen:
        return "the answer was cut while the model was reasoning"
    return None


def replay_body(request: ClientRequest, progress: Progress) -> dict[str, Any]:
    """The /v1/completions request that goes on from the committed boundary: prompt P + G,
    the client's per-token rules, and what is left of its output limit."""
    assert progress.prompt_ids is not None
    generated = progress.generated
    body: dict[str, Any] = {
        "model": request.body["model"],
        "prompt": progress.prompt_ids + generated,
    }
    for name in _CARRIED:
        if name in request.body:
            body[name] = request.body[name]
    limit = request.max_tokens
    if limit is not None:
        body["max_tokens"] = max(1, limit - len(generated))
    least = request.body.get("min_tokens")
    if type(least) is int and least > len(generated):
        body["min_tokens"] = least - len(generated)
    return body


def merged_usage(
    prompt_tokens: int, earlier: int, continuation: dict[str, Any] | None
) -> dict[str, Any]:
    """One usage for the whole answer: the original prompt's count, every token generated."""
    later = (continuation or {}).get("completion_tokens")
    completion = earlier + (later if type(later) is int else 0)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
    }
    return usage


@dataclass(frozen=True, slots=True)
class Head:
    """The members every event of the client's answer opens with."""

    id: Any
    object: Any
    created: Any
    model: Any

    @classmethod
    def of(cls, first: dict[str, Any]) -> Head:
        return cls(first.get("id"), first.get("object"), first.get("created"), first.get("model"))

    def members(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}


def rescued_event(
    payload: dict[str, Any], head: Head, *, chat: bool, keep_ids: bool
) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """A replay event (text_completion chunk) as the client's answer goes on.

    Returns the client's chunk, its choice as the engine sent it (None for a chunk with
    no choice) and the text it carries. Chat answers get `chat.completion.chunk` deltas.
    """
    choices = payload.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        return head.members() | {"choices": []}, None, ""
    text = choice.get("text")
    text = text if isinstance(text, str) else ""
    ids = choice.get("token_ids") if keep_ids else None
    if chat:
        out: dict[str, Any] = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason"),
        }
        if choice.get("finish_reason") is not None:
            out["stop_reason"] = choice.get("stop_reason")
        out["token_ids"] = ids
    else:
        out = dict(choice)
        out["prompt_token_ids"] = None
        out["token_ids"] = ids
    chunk = head.members() | {"choices": [out]}
    if "system_fingerprint" in payload:
        chunk["system_fingerprint"] = payload["system_fingerprint"]
    return chunk, choice, text


def drop_seen(chunk: dict[str, Any], seen: list[int]) -> list[int]:
    """Take from the client's rescued `chunk` the ids it already has: `seen`, delivered past
    the committed boundary, which the replay generates again. Returns what is left of
    `seen`; once the replay's ids differ (a sampled answer), none are dropped."""
    choice: dict[str, Any] = chunk["choices"][0] if chunk["choices"] else {}
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        return seen
    same = 0
    while same < min(len(ids), len(seen)) and ids[same] == seen[same]:
        same += 1
    if same < min(len(ids), len(seen)):
        return []
    choice["token_ids"] = ids[same:]
    return seen[same:]


def usage_chunk(head: Head, usage: dict[str, Any], fingerprint: object | None) -> dict[str, Any]:
    """The closing usage chunk of a continued stream."""
    chunk = head.members() | {"choices": [], "usage": usage}
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def refused_error(call: Call, error: NarwhalError | None, why: str, kind: str) -> NarwhalError:
    """The error a cut answer ends with when it is not continued (`why`, of `kind`): the
    consumer's failure, saying why; recorded on the call for the journal."""
    assert error is not None
    call.continuation_refused, call.refused_kind = why, kind
    return NarwhalError(
        error.status,
        f"{error.message}; the answer was not continued: {why}",
        error.cause,
        transient=error.transient,
        engine=error.engine,
    )

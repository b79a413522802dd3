"""The simulator's fidelity to real vLLM: the same requests, answers compared shape by shape.

`CASES` are the requests; `capture` records one answer (status, JSON body or SSE events,
or the series names of `/metrics`); `differences` compares two captures member by member,
by shape (which members exist, and the JSON type of each), since the tiny model's text
and the engines' ids and timings differ by nature. Recordings of real vLLM live in
`tests/data/vllm/` and are made anew, against whatever vLLM `.venv-vllm` holds, with
`make record-vllm` (which runs this module as a script against a real engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from narwhal.protocol.descriptor import prefill_request_params

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "vllm"
# The `/metrics` series the router reads; the simulator must publish each one.
ROUTER_READS = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_by_source_total",
        "vllm:cache_config_info",
        "process_start_time_seconds",
        # Read by the placement benchmark, as vLLM counts its prefix cache.
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    }
)
PROMPT = "The sea is deep and the whales sing under grey skies"
MESSAGES = [{"role": "user", "content": "Tell me about whales"}]


@dataclass(frozen=True, slots=True)
class Case:
    """One request; `{model}` in the body is the engine's served model name."""

    name: str
    method: str
    path: str
    body: dict[str, Any] | None = None


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "{model}", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "{model}", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, **fields}


USAGE = {"stream": True, "stream_options": {"include_usage": True}}
CASES = (
    Case("completion", "POST", "/v1/completions", _completion()),
    Case("completion_stream", "POST", "/v1/completions", _completion(stream=True)),
    Case("completion_stream_usage", "POST", "/v1/completions", _completion(**USAGE)),
    Case("chat", "POST", "/v1/chat/completions", _chat()),
    Case("chat_stream", "POST", "/v1/chat/completions", _chat(stream=True)),
    Case("chat_stream_usage", "POST", "/v1/chat/completions", _chat(**USAGE)),
    Case(
        "prefill",
        "POST",
        "/v1/completions",
        _completion(max_tokens=1, kv_transfer_params=prefill_request_params()),
    ),
    Case("error_max_tokens", "POST", "/v1/completions", _completion(max_tokens=10**7)),
    Case(
        "error_stream_options",
        "POST",
        "/v1/completions",
        _completion(stream_options={"include_usage": True}),
    ),
    Case("models", "GET", "/v1/models"),
    Case("version", "GET", "/version"),
    Case("metrics", "GET", "/metrics"),
)
_SERIES = re.compile(rb"^([A-Za-z_:][\w:]*)", re.MULTILINE)


def _with_model(value: Any, model: str) -> Any:
    if isinstance(value, dict):
        return {key: _with_model(item, model) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_model(item, model) for item in value]
    return model if value == "{model}" else value


async def capture(
    session: aiohttp.ClientSession, url: str, case: Case, model: str
) -> dict[str, Any]:
    """One answer as a recording: status, and the JSON body, SSE events or series names."""
    body = None if case.body is None else _with_model(case.body, model)
    async with session.request(case.method, url + case.path, json=body) as response:
        raw = await response.read()
        recorded: dict[str, Any] = {
            "status": response.status,
            "content_type": response.content_type,
        }
        if case.name == "metrics":
            recorded["series"] = sorted({name.decode() for name in _SERIES.findall(raw)})
        elif response.content_type == "text/event-stream":
            # The exact bytes too: framing (`data: `, blank lines, `[DONE]`) is compared.
            recorded["raw"] = raw.decode()
            recorded["events"] = [
                json.loads(data) if data != "[DONE]" else data
                for data in (
                    event.removeprefix("data: ")
                    for event in recorded["raw"].split("\n\n")
                    if event.startswith("data: ")
                )
            ]
        else:
            recorded["json"] = orjson.loads(raw) if raw else None
    return recorded


def shape(value: Any) -> Any:
    """What a JSON value looks like: members and types, not contents."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def _event_kind(event: Any) -> str:
    """Events are compared by kind, as their number depends on the text generated."""
    if event == "[DONE]":
        return "done"
    if "error" in event:
        return "error"
    choices = event.get("choices")
    if choices == []:
        return "usage"
    choice = choices[0]
    if choice.get("finish_reason") is not None:
        return "final"
    if "role" in (choice.get("delta") or {}):
        return "role"
    return "token"


# With a reasoning parser on, a token's text goes to `reasoning` or to `content` by what the
# model wrote, and the tiny model is trained on the machine that runs the suite, so what it
# writes differs from one machine to the next: the two members are compared as one `text`,
# and a member left null (nothing of that kind written) matches a string.
_TEXT_MEMBERS = ("content", "reasoning")


def _delta_text_as_one(delta: dict[str, Any], keep: bool) -> dict[str, Any]:
    """A delta's shape with its text member, whichever it is, named `text` (or left out)."""
    out = {key: value for key, value in delta.items() if key not in _TEXT_MEMBERS}
    if keep and any(member in delta for member in _TEXT_MEMBERS):
        out["text"] = "str"
    return out


def _message_text_as_one(message: dict[str, Any]) -> dict[str, Any]:
    """A message's shape with `content` and `reasoning` typed `text` whether null or not."""
    return {
        key: "text" if key in _TEXT_MEMBERS and value in ("str", "null") else value
        for key, value in message.items()
    }


def _event_shape(kind: str, event: Any) -> Any:
    event_shape = shape(event)
    if kind in ("token", "final") and isinstance(event_shape, dict):
        for choice in event_shape.get("choices", ()):
            if isinstance(choice.get("delta"), dict):
                # The final event's own text is not compared: its token may have written none.
                choice["delta"] = _delta_text_as_one(choice["delta"], keep=kind == "token")
    return event_shape


def _body_shape(body: Any) -> Any:
    body_shape = shape(body)
    if isinstance(body_shape, dict):
        for choice in body_shape.get("choices", ()):
            if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
                choice["message"] = _message_text_as_one(choice["message"])
    return body_shape


def _has_text(event_shape: Any) -> bool:
    choices = event_shape.get("choices") or [{}]
    return "text" in (choices[0].get("delta") or {})


def _compare(path: str, real: Any, sim: Any, out: list[str]) -> None:
    if isinstance(real, dict) and isinstance(sim, dict):
        for key in real.keys() - sim.keys():
            out.append(f"{path}.{key}: vLLM sends it, the simulator does not")
        for key in sim.keys() - real.keys():
            out.append(f"{path}.{key}: the simulator sends it, vLLM does not")
        for key in real.keys() & sim.keys():
            _compare(f"{path}.{key}", real[key], sim[key], out)
    elif isinstance(real, list) and isinstance(sim, list):
        if real and sim:
            _compare(f"{path}[0]", real[0], sim[0], out)
    elif real != sim:
        out.append(f"{path}: vLLM {real}, simulator {sim}")


def _framing(raw: str) -> tuple[bool, bool]:
    """Whether every event is one `data:` line ended by a blank line, and the last is
    `[DONE]`."""
    events = raw.split("\n\n")
    whole = events[-1] == "" and all(
        event.startswith("data: ") and "\n" not in event for event in events[:-1]
    )
    return whole, raw.endswith("data: [DONE]\n\n")


def differences(real: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    """Where the simulator's capture differs in shape from the recording of vLLM."""
    out: list[str] = []
    for key in ("status", "content_type"):
        if real[key] != sim[key]:
            out.append(f"{key}: vLLM {real[key]}, simulator {sim[key]}")
    if "raw" in real and _framing(real["raw"]) != _framing(sim.get("raw", "")):
        out.append("events: framed differently (each event `data: ...` and a blank line)")
    if "series" in real:
        missing = sorted(ROUTER_READS & set(real["series"]) - set(sim.get("series", ())))
        out += [f"metrics: {name}: vLLM publishes it, the simulator does not" for name in missing]
    elif "events" in real:
        kinds: dict[str, dict[str, Any]] = {"vLLM": {}, "simulator": {}}
        for who, capture_ in (("vLLM", real), ("simulator", sim)):
            for event in capture_.get("events", ()):
                kind = _event_kind(event)
                seen = kinds[who].get(kind)
                # The first token event that carries text stands for them all: vLLM also
                # sends token events with no text (held-back partial characters).
                if seen is None or (not _has_text(seen) and _has_text(_event_shape(kind, event))):
                    kinds[who][kind] = _event_shape(kind, event)
        for kind in kinds["vLLM"].keys() | kinds["simulator"].keys():
            if kind not in kinds["simulator"]:
                out.append(f"events: vLLM sends a {kind} event, the simulator does not")
            elif kind not in kinds["vLLM"]:
                out.append(f"events: the simulator sends a {kind} event, vLLM does not")
            else:
                _compare(kind, kinds["vLLM"][kind], kinds["simulator"][kind], out)
    else:
        _compare("body", _body_shape(real.get("json")), _body_shape(sim.get("json")), out)
    return out


async def record(url: str, model: str) -> dict[str, dict[str, Any]]:
    """Every case's answer from the engine at `url`, by case name."""
    async with aiohttp.ClientSession() as session:
        return {case.name: await capture(session, url, case, model) for case in CASES}


def write(recordings: dict[str, dict[str, Any]], out: Path) -> None:
    """One file a case, so that a newer vLLM's changes show case by case in a diff."""
    out.mkdir(parents=True, exist_ok=True)
    for name, recorded in recordings.items():
        (out / f"{name}.json").write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        print(f"recorded {name}: HTTP {recorded['status']}")


def load(out: Path = FIXTURES) -> dict[str, dict[str, Any]]:
    """The recordings, by case name."""
    return {case.name: json.loads((out / f"{case.name}.json").read_text()) for case in CASES}


async def record_fresh_engine() -> dict[str, dict[str, Any]]:
    """Start a real producer engine as the real-engine suite does (a reasoning parser on),
    and record it."""
    from narwhal.tools.vllm_fleet import VllmFleet, VllmOptions
    from support.real import KV_LEASE_S, MODEL, REASONING_PARSER, ROOT, TINY_MODEL, VLLM_PYTHON

    options = VllmOptions(
        python=VLLM_PYTHON,
        model=TINY_MODEL,
        served_model_name=MODEL,
        log_dir=ROOT / ".cache" / "record-logs",
        extra_args=("--reasoning-parser", REASONING_PARSER),
        kv_lease_duration_s=KV_LEASE_S,
    )
    async with VllmFleet(options, [("p0", "prefill")]) as fleet:
        return await record(fleet["p0"].url, MODEL)


def main() -> None:
    parser = argparse.ArgumentParser(description="Record vLLM's answers to the fidelity cases.")
    parser.add_argument("--url", help="a running engine (default: start one from .venv-vllm)")
    parser.add_argument("--model", help="the running engine's served model name")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    if args.url and not args.model:
        parser.error("--url needs --model")
    run = record(args.url, args.model) if args.url else record_fresh_engine()
    write(asyncio.run(run), args.out)


if __name__ == "__main__":
    main()

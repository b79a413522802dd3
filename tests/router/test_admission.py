"""Admission by tenant: the request's tenant, its limits, its claim and its settlement."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from narwhal.config.root import parse_config
from narwhal.config.tenants import TenantConfig, TenantsPolicy
from narwhal.protocol.bodies import ClientRequest, Endpoint, parse_client_request
from narwhal.protocol.errors import NarwhalError
from narwhal.router.admission import Admission, estimate_prompt_tokens
from narwhal.router.call import Call
from narwhal.tenants.limits import TenantLimits
from narwhal.tenants.store import LocalStore

KEYS = {"Bearer k-chat": "chat", "Bearer k-batch": "batch"}


def tenant_of(authorization: str | None) -> str | None:
    return KEYS.get(authorization or "")


def tenants(**batch: Any) -> tuple[TenantConfig, ...]:
    engines = [{"id": "e", "url": "http://10.0.0.1:1", "role": "both"}]
    config = parse_config(
        {
            "model": "m",
            "engines": engines,
            "tenants": [
                {"name": "chat", "priority": 0, "weight": 3, "ttft_objective_s": 2},
                {"name": "batch", "priority": 2, **batch},
            ],
        }
    )
    return config.tenants


def admission(configs: tuple[TenantConfig, ...], policy: TenantsPolicy | None = None) -> Admission:
    return Admission(
        configs, policy or TenantsPolicy(), tenant_of, TenantLimits(configs, LocalStore())
    )


def call() -> Call:
    return Call("r1", None, Endpoint.COMPLETIONS, time.perf_counter(), deadline=100.0)


def completion(**body: Any) -> ClientRequest:
    raw = {"model": "m", "prompt": "x" * 40, **body}
    return parse_client_request(Endpoint.COMPLETIONS, orjson.dumps(raw), "m")


def test_the_key_names_the_tenant_and_its_claim() -> None:
    made = call()
    admission(tenants()).admit(made, completion(max_tokens=6), "Bearer k-chat")
    assert made.tenant == "chat"
    assert made.claim is not None
    assert (made.claim.tenant, made.claim.priority, made.claim.weight) == ("chat", 0, 3.0)
    # 40 bytes of prompt at 4 bytes a token, plus max_tokens.
    assert made.claim.cost == 16.0
    assert made.claim.objective_s == 2.0
    assert made.claim.deadline == 100.0


def test_a_key_of_no_tenant_goes_to_the_default_else_to_none() -> None:
    made = call()
    policy = TenantsPolicy(default="batch")
    admission(tenants(), policy).admit(made, completion(), "Bearer other")
    assert made.tenant == "batch"
    alone = call()
    admission(tenants()).admit(alone, completion(), None)
    assert alone.tenant is None and alone.claim is None and alone.headers is None


def test_over_a_limit_is_refused_with_its_headers() -> None:
    gate = admission(tenants(requests_per_minute=1))
    first = call()
    gate.admit(first, completion(), "Bearer k-batch")
    assert first.headers is not None
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    second = call()
    with pytest.raises(NarwhalError) as refused:
        gate.admit(second, completion(), "Bearer k-batch")
    assert refused.value.status == 429
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.refusal == "requests_per_minute"
    # A bucket of 1 a minute holds a whole request again in about 60 s.
    assert refused.value.retry_after is not None and 55 <= refused.value.retry_after <= 60
    assert second.headers is not None and second.headers["x-ratelimit-remaining-requests"] == "0"


def test_ending_a_request_gives_back_its_place_once() -> None:
    gate = admission(tenants(max_concurrent=1))
    first = call()
    gate.admit(first, completion(), "Bearer k-batch")
    with pytest.raises(NarwhalError, match="max_concurrent"):
        gate.admit(call(), completion(), "Bearer k-batch")
    gate.ended(first, time.perf_counter())
    gate.ended(first, time.perf_counter())
    again = call()
    gate.admit(again, completion(), "Bearer k-batch")
    with pytest.raises(NarwhalError, match="max_concurrent"):
        gate.admit(call(), completion(), "Bearer k-batch")


def test_tokens_are_settled_on_the_usage_reported() -> None:
    gate = admission(tenants(tokens_per_minute=100))
    made = call()
    gate.admit(made, completion(max_tokens=50), "Bearer k-batch")
    assert made.headers is not None
    assert made.headers["x-ratelimit-remaining-tokens"] == "40"
    made.prompt_tokens, made.output_tokens = 9, 1
    gate.ended(made, time.perf_counter())
    # 60 reserved, 10 used: 50 come back (and the bucket refills meanwhile, at most to 100).
    assert 90 <= gate.limits.state(time.monotonic())["batch"]["tokens_level"] <= 100


def test_engine_priority_sends_the_band_else_a_clients_own_is_dropped() -> None:
    sent = completion(priority=-9)
    admission(tenants(), TenantsPolicy(engine_priority=True)).admit(call(), sent, "Bearer k-batch")
    assert sent.body["priority"] == 2
    dropped = completion(priority=-9)
    admission(tenants()).admit(call(), dropped, "Bearer k-batch")
    assert "priority" not in dropped.body


def test_an_update_applies_to_the_next_request() -> None:
    gate = admission(tenants())
    changed = tuple(TenantConfig(t.name, priority=5) if t.name == "batch" else t for t in tenants())
    gate.update(changed)
    made = call()
    gate.admit(made, completion(), "Bearer k-batch")
    assert made.claim is not None and made.claim.priority == 5


def test_prompt_tokens_are_estimated_from_text_or_counted_as_ids() -> None:
    chat = parse_client_request(
        Endpoint.CHAT,
        orjson.dumps(
            {
                "messages": [
                    {"role": "system", "content": "abcd" * 3},
                    {"role": "user", "content": [{"type": "text", "text": "é" * 2}]},
                ]
            }
        ),
        "m",
    )
    assert estimate_prompt_tokens(chat) == 3 + 1
    ids = completion(prompt=[1, 2, 3, 4, 5])
    assert estimate_prompt_tokens(ids) == 5
    text = parse_client_request(
        Endpoint.RESPONSES, orjson.dumps({"input": "abcd" * 2, "instructions": "abcd"}), "m"
    )
    assert estimate_prompt_tokens(text) == 2 + 1
    items = parse_client_request(
        Endpoint.RESPONSES,
        orjson.dumps(
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "abcd" * 5}]}]}
        ),
        "m",
    )
    assert estimate_prompt_tokens(items) == 5

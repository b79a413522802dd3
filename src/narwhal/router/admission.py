"""Admission by tenant: whose request this is, whether its limits let it in, and its claim
on the seat queue.

A request's tenant is named by its client key (`[[tenants]] api_keys`), else it is
`[tenants_policy] default`'s, else it has none and is admitted as every request was before
tenants existed. A tenant's limits (`tenants.limits`) are checked once, as the request
arrives: over one, it gets 429 with the `Retry-After` its bucket computes. Admitted, it
queues for seats under its tenant's band and weight (`fleet.scheduler`), its cost counted
in tokens: the prompt's, estimated here, plus `max_tokens`. When it ends, the tokens it
reserved are settled on what the engines reported and its place under `max_concurrent`
is given back, exactly once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from narwhal.config.tenants import TenantConfig, TenantsPolicy, tenant_patch
from narwhal.fleet.operations import OperationError
from narwhal.fleet.scheduler import Claim
from narwhal.protocol.bodies import ClientRequest, Endpoint
from narwhal.router.call import Call
from narwhal.tenants.limits import TenantLimits

# Bytes of prompt text per token, for the estimate made before any engine saw the prompt.
BYTES_PER_TOKEN = 4


class Admission:
    """Each request's tenant, limits and claim; and, once it ended, its settlement."""

    def __init__(
        self,
        tenants: Iterable[TenantConfig],
        policy: TenantsPolicy,
        tenant_of: Callable[[str | None], str | None],
        limits: TenantLimits,
    ) -> None:
        """`tenant_of`: the tenant an `Authorization` header's key names (`config.secrets`);
        `limits`: every tenant's buckets and counts, in this process or shared by workers."""
        self.policy = policy
        self.tenant_of = tenant_of
        self.limits = limits
        self.tenants: dict[str, TenantConfig] = {}
        self.update(tenants)

    def update(self, tenants: Iterable[TenantConfig], policy: TenantsPolicy | None = None) -> None:
        """New tenants' settings (and policy), from the admin API or a reloaded file: they
        apply to requests admitted from now on."""
        self.tenants = {tenant.name: tenant for tenant in tenants}
        if policy is not None:
            self.policy = policy
        self.limits.update(self.tenants.values(), time.monotonic())

    def change(self, name: str, body: object) -> TenantConfig:
        """The admin API's change to one tenant's band, weight or limits, applied at once;
        an `OperationError` names an unknown tenant or every problem of the body."""
        tenant = self.tenants.get(name)
        if tenant is None:
            known = ", ".join(sorted(self.tenants))
            raise OperationError(404, f"no tenant is named `{name}` (tenants: {known})")
        changed, problems = tenant_patch(tenant, body)
        if problems:
            raise OperationError(
                400, "; ".join(problems), param=problems[0].split(":")[0], problems=tuple(problems)
            )
        self.update(changed if t.name == name else t for t in self.tenants.values())
        return changed

    def tenant(self, authorization: str | None) -> TenantConfig | None:
        """The request's tenant: its key's, else the default, else none."""
        name = self.tenant_of(authorization) or self.policy.default
        return self.tenants.get(name) if name is not None else None

    def admit(self, call: Call, request: ClientRequest, authorization: str | None) -> None:
        """Name the request's tenant, take what its limits allow or raise the 429 they
        refuse with, and set its claim on the seat queue (and its band as the engines'
        `priority`, with `[tenants_policy] engine_priority`)."""
        tenant = self.tenant(authorization)
        if tenant is None:
            return
        call.tenant = tenant.name
        tokens = estimate_prompt_tokens(request) + (request.max_tokens or 0)
        now = time.monotonic()
        try:
            call.ticket = self.limits.admit(tenant.name, tokens, now)
        finally:
            headers = self.limits.headers(tenant.name, now)
            if headers:
                call.headers = headers
        # A tenant's band is the router's to give, not its clients': with the engines
        # scheduling by priority, a client's own `priority` would jump the queue.
        if self.policy.engine_priority:
            request.body["priority"] = tenant.priority
        else:
            request.body.pop("priority", None)
        call.claim = Claim(
            tenant=tenant.name,
            priority=tenant.priority,
            weight=tenant.weight,
            cost=float(max(tokens, 1)),
            max_queued=tenant.max_queued,
            objective_s=tenant.ttft_objective_s,
            deadline=call.deadline,
        )

    def ended(self, call: Call, now: float) -> None:
        """A call hook: settle the request's tokens on the engines' usage and end its count
        against `max_concurrent`."""
        ticket = call.ticket
        if ticket is None:
            return
        call.ticket = None
        clock = time.monotonic()
        if call.output_tokens is not None and call.prompt_tokens is not None:
            self.limits.settle(ticket, call.prompt_tokens + call.output_tokens, clock)
        self.limits.release(ticket, clock, now - call.arrival)


def estimate_prompt_tokens(request: ClientRequest) -> int:
    """The prompt's tokens before a tokenizer saw it: token ids counted, text by its UTF-8
    length at `BYTES_PER_TOKEN` bytes a token (rounded up)."""
    body = request.body
    if request.endpoint is Endpoint.COMPLETIONS:
        return _tokens_of(body.get("prompt"))
    total = 0
    if request.endpoint is Endpoint.RESPONSES:
        # This turn's own input and instructions (the conversation it follows is counted
        # when the engines report their usage).
        items = body.get("input")
        total = _tokens_of(body.get("instructions"))
        if isinstance(items, str):
            return total + _tokens_of(items)
        for item in items or ():
            if isinstance(item, dict):
                total += _tokens_of(item.get("content"))
        return total
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            total += _tokens_of(message.get("content"))
    return total


def _tokens_of(value: Any) -> int:
    if isinstance(value, str):
        return math.ceil(len(value.encode()) / BYTES_PER_TOKEN)
    if isinstance(value, list):
        if value and all(type(item) is int for item in value):
            return len(value)
        total = 0
        for item in value:
            if isinstance(item, dict):
                total += _tokens_of(item.get("text"))
            else:
                total += _tokens_of(item)
        return total
    return 0

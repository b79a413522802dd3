"""The last check before a decode is sent: may this prefill's descriptor be handed over?

Kept apart from the client's transport so that the router can time it as a step of its own.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from narwhal.engines.connector import PrefillResult
from narwhal.engines.hosts import HostResolver
from narwhal.protocol.descriptor import DEFECT_MESSAGES, Defect, check_descriptor, check_handoff
from narwhal.protocol.errors import Cause, NarwhalError, engine_error


class DescriptorRejected(NarwhalError):
    """A descriptor that failed validation; `defect` says which rule it broke."""

    def __init__(self, defect: Defect, engine: str) -> None:
        error = engine_error(
            Cause.DESCRIPTOR,
            f"engine {engine} sent a bad handoff descriptor: {DEFECT_MESSAGES[defect]}",
            engine,
        )
        super().__init__(
            error.status, error.message, error.cause, transient=error.transient, engine=engine
        )
        self.defect = defect


async def checked_descriptor(
    hosts: HostResolver,
    consumer_url: str,
    endpoint: str,
    result: PrefillResult,
    connector: str,
) -> bytes | None:
    """The descriptor to send, after every rule; None means a plain (recomputing) decode.

    Last rule: the descriptor may only send the consumer to the producer that issued
    it, so a misbehaving engine cannot steer KV pulls elsewhere.
    """
    if result.descriptor is None or consumer_url == result.producer_url:
        # Never point a descriptor at its own engine: the prefix cache serves it.
        return None
    name = result.producer or result.producer_url
    params = result.parameters()
    defect = check_descriptor(params) or check_handoff(
        prefill_connector=result.connector,
        decode_connector=connector,
        prefill_endpoint=result.endpoint,
        decode_endpoint=endpoint,
    )
    if defect is None:
        remote_host = params.get("remote_host")
        allowed = (urlsplit(result.producer_url).hostname or "", *result.kv_hosts)
        if not isinstance(remote_host, str) or not await hosts.same_machine(remote_host, allowed):
            defect = Defect.FOREIGN_HOST
    if defect is not None:
        raise DescriptorRejected(defect, name)
    return result.descriptor

"""The handoff descriptor (`kv_transfer_params`): what a prefill asks for, what a decode carries.

The rules are pure: a descriptor either passes or has exactly one named defect. Fields
the rules do not name are opaque engine state and are never touched.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


def prefill_request_params() -> dict[str, Any]:
    """What the producer is sent: keep the prompt's blocks for a remote decode."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


class Defect(StrEnum):
    """Why a descriptor was rejected; bounded, so usable as a metrics label."""

    NOT_AN_OBJECT = "not_an_object"
    MISSING_ENGINE_ID = "missing_engine_id"
    MALFORMED_BLOCK_IDS = "malformed_block_ids"
    CONNECTOR_MISMATCH = "connector_mismatch"
    ENDPOINT_MISMATCH = "endpoint_mismatch"
    FOREIGN_HOST = "foreign_host"


DEFECT_MESSAGES = {
    Defect.NOT_AN_OBJECT: "kv_transfer_params is not a JSON object",
    Defect.MISSING_ENGINE_ID: "remote_engine_id is missing or not a non-empty string",
    Defect.MALFORMED_BLOCK_IDS: (
        "remote_block_ids is not a list of non-negative integers or of such lists"
    ),
    Defect.CONNECTOR_MISMATCH: "the producer's KV connector differs from the consumer's",
    Defect.ENDPOINT_MISMATCH: "the prefill ran on a different route than the decode",
    Defect.FOREIGN_HOST: (
        "remote_host does not resolve to the producer's own host (nor to one of its kv_hosts)"
    ),
}


def _block_ids(items: list[object]) -> bool:
    # bool is a subclass of int, and True is not a block id. One pass, no call per id:
    # a prompt of thousands of tokens has hundreds of them.
    return all(type(item) is int and item >= 0 for item in items)


def block_ids_ok(value: object) -> bool:
    """A flat list of block ids, or one list per KV-cache group."""
    if not isinstance(value, list):
        return False
    if _block_ids(value):
        return True
    return all(isinstance(group, list) and _block_ids(group) for group in value)


def check_descriptor(params: object) -> Defect | None:
    """The field rules a descriptor must pass before any decode request is made."""
    if not isinstance(params, dict):
        return Defect.NOT_AN_OBJECT
    engine_id = params.get("remote_engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        return Defect.MISSING_ENGINE_ID
    if not block_ids_ok(params.get("remote_block_ids")):
        return Defect.MALFORMED_BLOCK_IDS
    return None


def check_handoff(
    *,
    prefill_connector: str,
    decode_connector: str,
    prefill_endpoint: str,
    decode_endpoint: str,
) -> Defect | None:
    """The pairing rules: a descriptor only fits a decode of the same connector and route."""
    if prefill_connector != decode_connector:
        return Defect.CONNECTOR_MISMATCH
    if prefill_endpoint != decode_endpoint:
        return Defect.ENDPOINT_MISMATCH
    return None

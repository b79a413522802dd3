"""Descriptor rules: one named defect or none; fields the rules do not name are never judged."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.protocol.descriptor import (
    Defect,
    block_ids_ok,
    check_descriptor,
    check_handoff,
    prefill_request_params,
)


def good(**changes: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "5f1c",
        "remote_block_ids": [12, 13, 14],
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 1,
    }
    params.update(changes)
    return params


def test_a_contract_descriptor_passes() -> None:
    assert check_descriptor(good()) is None


def test_per_group_block_ids_pass() -> None:
    assert check_descriptor(good(remote_block_ids=[[12, 13], [40]])) is None


def test_unknown_fields_are_not_judged() -> None:
    assert check_descriptor(good(transfer_mode="read", dcp_size=None, future={"a": [1]})) is None


@pytest.mark.parametrize("engine_id", [None, "", 7, ["x"], True])
def test_engine_identity_must_be_a_non_empty_string(engine_id: object) -> None:
    assert check_descriptor(good(remote_engine_id=engine_id)) is Defect.MISSING_ENGINE_ID


def test_missing_engine_identity_is_a_defect() -> None:
    params = good()
    del params["remote_engine_id"]
    assert check_descriptor(params) is Defect.MISSING_ENGINE_ID


@pytest.mark.parametrize(
    "block_ids",
    [None, 3, "1,2", [1, -1], [1.0], ["1"], [True], [[1], 2], [[1, [2]]], [[False]], {"a": 1}],
)
def test_malformed_block_ids_are_a_defect(block_ids: object) -> None:
    assert check_descriptor(good(remote_block_ids=block_ids)) is Defect.MALFORMED_BLOCK_IDS


@pytest.mark.parametrize("params", [None, [], "x", 5])
def test_a_descriptor_must_be_an_object(params: object) -> None:
    assert check_descriptor(params) is Defect.NOT_AN_OBJECT


@given(st.lists(st.integers(min_value=0, max_value=2**40)))
def test_any_list_of_non_negative_ints_is_valid(ids: list[int]) -> None:
    assert block_ids_ok(ids)
    assert block_ids_ok([ids, ids])


@given(st.lists(st.integers(), min_size=1))
def test_a_negative_id_anywhere_is_invalid(ids: list[int]) -> None:
    ids = [*ids, -1]
    assert not block_ids_ok(ids)
    assert not block_ids_ok([[0], ids])


def test_handoff_must_keep_connector_and_route() -> None:
    same = {"prefill_endpoint": "/v1/completions", "decode_endpoint": "/v1/completions"}
    assert (
        check_handoff(prefill_connector="NixlConnector", decode_connector="NixlConnector", **same)
        is None
    )
    assert (
        check_handoff(prefill_connector="NixlConnector", decode_connector="LMCache", **same)
        is Defect.CONNECTOR_MISMATCH
    )
    assert (
        check_handoff(
            prefill_connector="NixlConnector",
            decode_connector="NixlConnector",
            prefill_endpoint="/v1/completions",
            decode_endpoint="/v1/chat/completions",
        )
        is Defect.ENDPOINT_MISMATCH
    )


def test_the_prefill_request_asks_for_a_remote_decode() -> None:
    params = prefill_request_params()
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert all(params[k] is None for k in ("remote_engine_id", "remote_block_ids"))
    assert params is not prefill_request_params()

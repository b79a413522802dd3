"""Errors as values: an engine's own complaint about a request reaches the client unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.protocol.errors import Cause, client_error, engine_error
from narwhal.protocol.sse import error_detail

VLLM_400: dict[str, Any] = {
    "error": {
        "message": "Stream options can only be defined when `stream=True`.",
        "type": "Bad Request",
        "param": "stream_options",
        "code": 400,
    }
}


def test_the_error_object_is_read_from_the_newer_and_the_older_shape() -> None:
    assert error_detail(VLLM_400) == VLLM_400["error"]
    older = {"object": "error", **VLLM_400["error"]}
    assert error_detail(older) == VLLM_400["error"]
    assert error_detail({"error": {"code": 400}}) is None


@pytest.mark.parametrize("cause", [Cause.HTTP_STATUS, Cause.ERROR_OBJECT])
def test_an_engine_4xx_is_answered_with_the_engines_own_error_object(cause: Cause) -> None:
    error = engine_error(cause, "prefix: message", "p0", status=400, detail=VLLM_400["error"])
    assert error.cause is Cause.BAD_REQUEST and error.status == 400
    assert error.body() == VLLM_400


def test_an_engine_fault_is_answered_in_the_routers_words() -> None:
    error = engine_error(Cause.HTTP_STATUS, "boom", "p0", status=500, detail=VLLM_400["error"])
    assert error.status == 502
    assert error.body()["error"] == {
        "message": "boom",
        "type": "BadGatewayError",
        "param": None,
        "code": 502,
    }


def test_a_client_error_names_its_field() -> None:
    assert client_error(400, "bad", "stream_options").body()["error"]["param"] == "stream_options"

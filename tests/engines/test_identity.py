"""An engine's `/v1/models` listing read as its base model, its adapters and their cards."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.engines.identity import ModelCard, served_models
from narwhal.tools.sim.describe import models
from narwhal.tools.sim.lora import Adapter
from narwhal.tools.sim.options import SimOptions


def _card(id: str, parent: str | None, **members: Any) -> dict[str, Any]:
    return {
        "id": id,
        "object": "model",
        "created": 1,
        "owned_by": "vllm",
        "parent": parent,
        **members,
    }


def test_a_listing_as_vllm_builds_it_gives_its_base_and_adapters_in_order() -> None:
    options = SimOptions(model="m-a", max_model_len=4096)
    listing = models(options, [Adapter("sql", "/a/sql", 1), Adapter("poet", "/a/poet", 2)])
    served = served_models(listing)
    assert served.base == "m-a"
    assert served.names == ()
    assert served.adapters == ("sql", "poet")
    assert served.cards["m-a"] == ModelCard("m-a", "m-a", None, 4096, "vllm")
    assert served.cards["sql"] == ModelCard("sql", "/a/sql", "m-a", None, "vllm")
    assert served.serves("m-a") and not served.serves("sql")


def test_several_served_names_make_the_first_the_base_and_the_rest_its_names() -> None:
    served = served_models({"object": "list", "data": [_card("big", None), _card("big-too", None)]})
    assert served.base == "big"
    assert served.names == ("big-too",)
    assert served.serves("big-too")


def test_odd_entries_are_skipped_and_odd_members_read_as_absent() -> None:
    served = served_models(
        {
            "data": [
                "not a card",
                {"object": "model"},
                _card("m", None, root=7, max_model_len=True, owned_by=None),
                _card("m", "someone else"),
                _card("lora", "m", max_model_len="big"),
            ]
        }
    )
    assert served.base == "m"
    assert served.cards["m"] == ModelCard("m")
    assert served.cards["lora"] == ModelCard("lora", parent="m", owned_by="vllm")
    assert served.adapters == ("lora",)


def test_a_listing_of_adapters_only_names_no_base() -> None:
    assert served_models({"data": [_card("lora", "m")]}).base is None
    assert served_models({"data": []}).base is None


@pytest.mark.parametrize("listing", [None, [], {}, {"data": "m"}, {"object": "list"}])
def test_what_is_no_listing_is_refused(listing: Any) -> None:
    with pytest.raises(ValueError, match="data"):
        served_models(listing)

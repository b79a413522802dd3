"""The names clients use for the pools: base models, aliases and adapters."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from narwhal.config.root import parse_config
from narwhal.fleet.models import Catalog, Target
from narwhal.protocol.errors import NarwhalError

FLEET = {
    "engines": [
        {"id": "a-p", "url": "http://a:1", "role": "prefill", "model": "alpha"},
        {"id": "a-d", "url": "http://a:2", "role": "decode", "model": "alpha"},
        {"id": "b-p", "url": "http://b:1", "role": "prefill", "model": "beta"},
        {"id": "b-d", "url": "http://b:2", "role": "decode", "model": "beta"},
    ],
    "models": [{"name": "alpha", "aliases": ["a", "gpt-small"]}],
    "lora": {"adapters": [{"name": "alpha-sql", "path": "/loras/sql", "base": "alpha"}]},
}


@dataclass
class Listed:
    model: str
    adapters: dict[str, None] = field(default_factory=dict)


def catalog() -> Catalog:
    return Catalog.from_config(parse_config(FLEET))


def test_base_models_aliases_and_adapters_resolve_to_their_pool() -> None:
    names = catalog()
    assert names.resolve("alpha") == Target("alpha")
    assert names.resolve("beta") == Target("beta")
    assert names.resolve("gpt-small") == Target("alpha")
    assert names.resolve("alpha-sql") == Target("alpha", "alpha-sql")
    assert names.resolve("alpha-sql").served == "alpha-sql"
    assert names.resolve("a").served == "alpha"


def test_the_default_model_is_the_first_one_named() -> None:
    assert catalog().default == "alpha"


def test_an_unknown_name_is_an_openai_shaped_404_that_names_it() -> None:
    with pytest.raises(NarwhalError) as caught:
        catalog().resolve("gamma")
    error = caught.value
    assert error.status == 404
    assert error.message.startswith("The model `gamma` does not exist.")
    assert "`alpha`" in error.message and "`beta`" in error.message
    body = error.body()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert body["type"] == "NotFoundError"


def test_names_engines_list_are_learnt_and_forgotten_with_them() -> None:
    names = catalog()
    names.learn([Listed("alpha", {"alpha-chat": None}), Listed("gamma")])
    assert names.resolve("alpha-chat") == Target("alpha", "alpha-chat")
    assert names.resolve("gamma") == Target("gamma")
    names.learn([Listed("alpha")])
    with pytest.raises(NarwhalError):
        names.resolve("alpha-chat")
    # What the configuration names stays, engine or none.
    assert names.resolve("alpha-sql") == Target("alpha", "alpha-sql")


def test_an_engine_cannot_take_a_name_the_configuration_gave() -> None:
    names = catalog()
    names.learn([Listed("beta", {"gpt-small": None})])
    assert names.resolve("gpt-small") == Target("alpha")


def test_one_model_fleets_are_not_several() -> None:
    one = Catalog.single("m")
    one.learn([Listed("m"), Listed("m")])
    assert not one.several
    assert catalog().several
    adapters_only = Catalog.single("m")
    adapters_only.learn([Listed("m", {"lora": None})])
    assert adapters_only.several

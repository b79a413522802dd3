"""Client and operator keys, engine credentials, descriptor hosts and TLS to engines."""

from __future__ import annotations

import logging
import ssl
import subprocess
from pathlib import Path

import aiohttp
import openai
import pytest

from narwhal.app.server import RouterServer
from narwhal.config.root import parse_config
from narwhal.config.secrets import Secrets, SecretsError, bearer_allowed, load_secrets
from narwhal.tools.sim.engine import SimEngine
from support.stack import COMPLETION, FAST, MODEL, StackFactory, settled

CLIENT_KEY = "sk-client-0123456789"
ADMIN_KEY = "sk-admin-9876543210"
ENGINE_KEY = "sk-engine-5555555555"
SECRETS = Secrets(
    client_keys=(CLIENT_KEY.encode(),),
    admin_keys=(ADMIN_KEY.encode(),),
    engine_key=ENGINE_KEY,
)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_client_routes_need_a_client_key(make_stack: StackFactory) -> None:
    async with make_stack(secrets=SECRETS) as stack:
        url = stack.url + "/v1/completions"
        for headers in ({}, bearer("sk-wrong"), bearer(ADMIN_KEY), {"Authorization": CLIENT_KEY}):
            async with stack.http.post(url, json=COMPLETION, headers=headers) as response:
                assert response.status == 401
                body = await response.json()
                assert body["error"]["code"] == 401
                assert "invalid API key" in body["error"]["message"]
        assert len(stack.engine("p0").received) == 0
        async with stack.http.post(url, json=COMPLETION, headers=bearer(CLIENT_KEY)) as response:
            assert response.status == 200
        with pytest.raises(openai.AuthenticationError):
            await stack.openai().completions.create(model=MODEL, prompt="x", max_tokens=2)
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=CLIENT_KEY)
        answer = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert answer.usage is not None and answer.usage.completion_tokens == 2


async def test_operator_routes_need_the_admin_key_and_health_is_open(
    make_stack: StackFactory,
) -> None:
    async with make_stack(secrets=SECRETS) as stack:
        state = stack.url + "/narwhal/state"
        async with stack.http.get(state, headers=bearer(CLIENT_KEY)) as response:
            assert response.status == 401
        async with stack.http.get(state, headers=bearer(ADMIN_KEY)) as response:
            assert response.status == 200
        async with stack.http.get(stack.url + "/health") as response:
            assert response.status == 200
        async with stack.http.get(stack.url + "/metrics") as response:
            assert response.status == 401


async def test_the_fleet_page_loads_without_a_key_but_its_data_needs_one(
    make_stack: StackFactory,
) -> None:
    async with make_stack(secrets=SECRETS) as stack:
        for path in ("/", "/narwhal/", "/narwhal/static/fleet.js"):
            async with stack.http.get(stack.url + path) as response:
                assert response.status == 200, path
                if path.endswith(".js"):
                    assert "Authorization" in await response.text()
        async with stack.http.get(stack.url + "/narwhal/state") as response:
            assert response.status == 401


async def test_engines_get_the_engine_key_and_never_the_clients(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with make_stack(secrets=SECRETS) as stack:
        async with stack.http.post(
            stack.url + "/v1/completions", json=COMPLETION, headers=bearer(CLIENT_KEY)
        ) as response:
            assert response.status == 200
        received = [*stack.engine("p0").received, *stack.engine("d0").received]
        assert [r.authorization for r in received] == [f"Bearer {ENGINE_KEY}"] * 2
        await stack.journal()
        journal = stack.journal_path.read_text()
    for secret in (CLIENT_KEY, ADMIN_KEY, ENGINE_KEY):
        assert secret not in journal and secret not in caplog.text


def test_keys_are_read_from_the_named_environment_variables() -> None:
    config = parse_config(
        {
            "model": MODEL,
            "server": {"api_keys": ["a"], "api_keys_env": "CLIENT_KEYS"},
            "engine": {"api_key_env": "ENGINE_KEY"},
            "engines": [{"id": "b0", "url": "http://127.0.0.1:9", "role": "both"}],
        }
    )
    secrets = load_secrets(config, {"CLIENT_KEYS": " b , c ", "ENGINE_KEY": "e"})
    assert secrets.client_keys == (b"a", b"b", b"c") and secrets.engine_key == "e"
    assert "e" not in repr(secrets).replace("Secrets", "")
    with pytest.raises(SecretsError, match="ENGINE_KEY, which is unset"):
        load_secrets(config, {"CLIENT_KEYS": "b"})


def test_admin_keys_can_come_from_a_variable_too() -> None:
    config = parse_config(
        {
            "model": MODEL,
            "server": {"admin_api_keys": ["x"], "admin_api_keys_env": "ADMIN_KEYS"},
            "engines": [{"id": "b0", "url": "http://127.0.0.1:9", "role": "both"}],
        }
    )
    assert load_secrets(config, {"ADMIN_KEYS": "y,z"}).admin_keys == (b"x", b"y", b"z")
    with pytest.raises(SecretsError, match="admin_api_keys_env names ADMIN_KEYS, which is unset"):
        load_secrets(config, {})


def test_bearer_matching_is_exact() -> None:
    keys = (b"alpha", b"beta")
    assert bearer_allowed("Bearer beta", keys)
    assert not bearer_allowed("Bearer bet", keys)
    assert not bearer_allowed("Basic beta", keys)
    assert not bearer_allowed(None, keys)


async def test_a_descriptor_pointing_elsewhere_is_rejected(make_stack: StackFactory) -> None:
    async with make_stack(sim_by_engine={"p0": {"side_channel_host": "127.0.0.2"}}) as stack:
        status, body = await stack.post("/v1/completions", COMPLETION)
        assert status == 502
        assert (
            "remote_host does not resolve to the producer's own host" in (body["error"]["message"])
        )
        assert len(stack.engine("d0").received) == 0
        await settled(stack)


async def test_kv_hosts_allow_a_separate_side_channel_address(make_stack: StackFactory) -> None:
    async with make_stack(
        sim_by_engine={"p0": {"side_channel_host": "127.0.0.2"}},
        engine_keys={"p0": {"kv_hosts": ["127.0.0.2"]}},
    ) as stack:
        status, _ = await stack.post("/v1/completions", COMPLETION)
        assert status == 200


def make_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_https_engines_are_verified_against_the_ca_bundle(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    engine = SimEngine(FAST, ssl_context=context)
    await engine.start()
    try:
        assert engine.url.startswith("https://")
        for bundle, expected in ((str(cert), 200), (None, 502)):
            config = parse_config(
                {
                    "model": MODEL,
                    "engine": {"ca_bundle": bundle} if bundle else {},
                    "engines": [{"id": "b0", "url": engine.url, "role": "both"}],
                }
            )
            server = RouterServer(config, port=0)
            await server.start()
            try:
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(server.url + "/v1/completions", json=COMPLETION) as response,
                ):
                    assert response.status == expected, await response.text()
            finally:
                await server.stop()
    finally:
        await engine.stop()

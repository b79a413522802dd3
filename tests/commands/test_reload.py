"""`narwhal reload`: the file is checked here first, then the router's own answer is shown."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from narwhal.commands.reload import reload_command

FILE = """model = "m"
[server]
port = {port}
admin_api_keys = ["sk-admin-5555555555"]
[[engines]]
id = "b0"
url = "http://10.0.0.1:8100"
role = "both"
"""


@pytest.fixture
async def router() -> AsyncIterator[tuple[int, list[Any], dict[str, Any]]]:
    """A stand-in router: records the Authorization header, answers as told."""
    seen: list[Any] = []
    answer: dict[str, Any] = {"status": 200, "body": {"added": ["d9"]}}

    async def reload(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response(answer["body"], status=answer["status"])

    app = web.Application()
    app.router.add_post("/narwhal/reload", reload)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield port, seen, answer
    finally:
        await runner.cleanup()


async def test_it_calls_the_router_of_the_file_with_its_admin_key(
    tmp_path: Path,
    router: tuple[int, list[Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    port, seen, _ = router
    path = tmp_path / "fleet.toml"
    path.write_text(FILE.format(port=port))
    assert await reload_command(path, None) == 0
    assert seen == ["Bearer sk-admin-5555555555"]
    assert '"added"' in capsys.readouterr().out


async def test_the_routers_refusal_is_shown_with_every_problem(
    tmp_path: Path,
    router: tuple[int, list[Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    port, _, answer = router
    answer.update(
        status=400,
        body={"error": {"message": "no", "problems": ["engines: d0: url changed", "other"]}},
    )
    path = tmp_path / "fleet.toml"
    path.write_text(FILE.format(port=8000))
    assert await reload_command(path, f"http://127.0.0.1:{port}/") == 1
    err = capsys.readouterr().err
    assert "reload refused (HTTP 400)" in err and "  engines: d0: url changed\n  other" in err


async def test_an_invalid_file_is_not_sent(
    tmp_path: Path,
    router: tuple[int, list[Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    port, seen, _ = router
    path = tmp_path / "fleet.toml"
    path.write_text(FILE.format(port=port).replace('"both"', '"all"'))
    assert await reload_command(path, None) == 1
    assert seen == []
    assert "engines[0].role: must be one of" in capsys.readouterr().err


async def test_no_router_listening_is_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    path = tmp_path / "fleet.toml"
    path.write_text(FILE.format(port=port))
    assert await reload_command(path, None, timeout_s=10.0) == 2
    assert f"no router reached at http://127.0.0.1:{port}" in capsys.readouterr().err

"""`narwhal reload`: ask a running router to re-read its config file, and show the outcome.

It calls `POST /narwhal/reload` rather than signalling a process, so that it works across
hosts and containers and the router's answer (what was added, changed, removed, or why the
file was refused) comes back here. The file is validated locally first; the router's
address and admin key come from it (`server.host`, `server.port`, `server.admin_api_keys`)
unless `--url` names the router. The router re-reads the file it was started from.
"""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import orjson

from narwhal.config.root import ConfigError, load_config

_ANY_HOST = frozenset({"0.0.0.0", "::", ""})


async def reload_command(path: Path, url: str | None, timeout_s: float = 30.0) -> int:
    """The exit code: 0 reloaded, 1 refused (by the file's own check or the router), 2 no
    router reached."""
    try:
        config = load_config(path)
    except ConfigError as error:
        print(error.report(), file=sys.stderr)
        print("not reloaded: fix the file first", file=sys.stderr)
        return 1
    server = config.server
    if url is None:
        host = "127.0.0.1" if server.host in _ANY_HOST else server.host
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{server.port}"
    keys = server.admin_api_keys
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.post(url.rstrip("/") + "/narwhal/reload", headers=headers) as response,
        ):
            status, raw = response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        print(f"no router reached at {url}: {error or 'timed out'}", file=sys.stderr)
        return 2
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        answer = {"error": {"message": raw.decode(errors="replace")[:300]}}
    if status != 200:
        refusal = answer.get("error", {}) if isinstance(answer, dict) else {}
        print(f"reload refused (HTTP {status}):", file=sys.stderr)
        for problem in refusal.get("problems") or [refusal.get("message", "")]:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode())
    return 0

"""`narwhal top` against a live router: in a real terminal (tmux), and once for scripts."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from support.stack import COMPLETION, MODEL, Stack, StackFactory

# A busy 2-core machine may take a while to start a Python process and draw.
PATIENCE_S = 30.0


async def run(*argv: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(process.communicate(), PATIENCE_S)
    assert process.returncode is not None
    return process.returncode, out.decode()


class Tmux:
    """One detached tmux session on a server of its own (its own socket)."""

    def __init__(self) -> None:
        self.socket = f"narwhal-test-{uuid.uuid4().hex[:8]}"

    async def tmux(self, *args: str) -> str:
        status, out = await run("tmux", "-L", self.socket, *args)
        assert status == 0, out
        return out

    async def screen(self) -> str:
        return await self.tmux("capture-pane", "-p", "-t", "top")

    async def wait_for(self, wanted: Callable[[str], bool], what: str) -> str:
        loop = asyncio.get_running_loop()
        until = loop.time() + PATIENCE_S
        screen = ""
        while loop.time() < until:
            screen = await self.screen()
            if wanted(screen):
                return screen
            await asyncio.sleep(0.1)
        raise AssertionError(f"the screen never showed {what}:\n{screen}")


@pytest.fixture
async def tmux() -> AsyncIterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("no tmux on PATH (make test installs it with apt-get where it can)")
    session = Tmux()
    try:
        yield session
    finally:
        await run("tmux", "-L", session.socket, "kill-server")


def top_command(stack: Stack) -> str:
    narwhal = f"{sys.executable} -m narwhal top --url {stack.url} --interval 0.2"
    # The pane stays after top exits, so that its exit status can be read.
    return f"{narwhal}; echo top exited with $?; sleep 120"


async def start_top(tmux: Tmux, stack: Stack) -> None:
    # The tmux server this starts lives on: it must not hold a pipe of ours open.
    process = await asyncio.create_subprocess_exec(
        "tmux", "-L", tmux.socket, "new-session", "-d", "-s", "top", "-x", "160", "-y", "50",
        "-e", f"PYTHONPATH={os.pathsep.join(sys.path)}", top_command(stack),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert await asyncio.wait_for(process.wait(), PATIENCE_S) == 0


def requests_line(screen: str) -> str:
    return next((line for line in screen.splitlines() if line.startswith("requests")), "")


async def test_top_shows_the_fleet_and_follows_requests_then_quits_on_q(
    make_stack: StackFactory, tmux: Tmux
) -> None:
    async with make_stack() as stack:
        await start_top(tmux, stack)
        screen = await tmux.wait_for(
            lambda s: "requests (last 5 min): 0 " in s and "\nd0 " in s, "the empty fleet"
        )
        assert "narwhal top · " + stack.url in screen
        rows = {line.split()[0]: line.split() for line in screen.splitlines() if line.strip()}
        assert rows["p0"][:5] == ["p0", MODEL, "prefill", "admitted", "0/64"]
        assert rows["d0"][:6] == ["d0", MODEL, "decode", "admitted", "-", "0/256"]

        for _ in range(3):
            assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        screen = await tmux.wait_for(
            lambda s: requests_line(s).startswith("requests (last 5 min): 3 "), "3 requests"
        )
        assert "ok 3" in requests_line(screen)
        assert "handoffs: crossed 3" in screen

        await tmux.tmux("send-keys", "-t", "top", "q")
        screen = await tmux.wait_for(lambda s: "top exited with" in s, "top exiting")
        assert "top exited with 0" in screen
        # Back on the normal screen: the frame was drawn on the alternate one.
        assert "requests (last 5 min)" not in screen


async def test_top_quits_cleanly_on_ctrl_c(make_stack: StackFactory, tmux: Tmux) -> None:
    async with make_stack() as stack:
        await start_top(tmux, stack)
        await tmux.wait_for(lambda s: "\np0 " in s, "the fleet")
        await tmux.tmux("send-keys", "-t", "top", "C-c")
        screen = await tmux.wait_for(lambda s: "top exited with" in s, "top exiting")
        assert "top exited with 0" in screen and "Traceback" not in screen


async def test_top_once_prints_one_frame_for_scripts(make_stack: StackFactory) -> None:
    async with make_stack() as stack:
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        status, out = await run(
            sys.executable, "-m", "narwhal", "top", "--url", stack.url, "--once"
        )
        assert status == 0, out
        assert "\x1b" not in out and "q quits" not in out
        assert "requests (last 5 min): 1 " in out
        assert any(line.startswith("p0 ") for line in out.splitlines())
        status, out = await run(
            sys.executable, "-m", "narwhal", "top", "--url", "http://127.0.0.1:9", "--once"
        )
        assert status == 1 and "router unreachable" in out

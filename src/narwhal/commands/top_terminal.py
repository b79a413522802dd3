"""`narwhal top`'s loop: read `/narwhal/state`, redraw in place, quit on `q` or Ctrl-C.

No dependencies beyond the standard library's terminal control: the frame is drawn on the
terminal's alternate screen with ANSI cursor moves, and the terminal is put back as it was
on every way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TextIO

import aiohttp

from narwhal.commands.top import failures_of, render

# Failures that grew within this window are shown as recent (as on the fleet page).
RECENT_S = 300.0
ENTER = "\x1b[?1049h\x1b[?25l"  # alternate screen, cursor hidden
LEAVE = "\x1b[?25h\x1b[?1049l"


async def fetch(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[dict[str, Any] | None, str | None]:
    """The router's state, or None and why it could not be read."""
    try:
        async with http.get(url.rstrip("/") + "/narwhal/state", headers=headers) as response:
            if response.status == 401:
                return None, "401: give the admin key (--admin-key or NARWHAL_ADMIN_KEY)"
            if response.status != 200:
                return None, f"HTTP {response.status}"
            state: dict[str, Any] = await response.json()
            return state, None
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return None, str(exc) or type(exc).__name__


class FailureHistory:
    """Failure counters seen over the last `RECENT_S`, to tell new failures from old."""

    def __init__(self, window_s: float = RECENT_S) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, dict[str, dict[str, int]]]] = deque()

    def add(self, state: dict[str, Any], now: float) -> dict[str, dict[str, int]]:
        """Remember this frame's counters; returns the oldest within the window."""
        self._seen.append((now, failures_of(state)))
        while len(self._seen) > 1 and now - self._seen[1][0] >= self.window_s:
            self._seen.popleft()
        return self._seen[0][1]


class Screen:
    """The terminal in cbreak mode on its alternate screen; restored on exit."""

    def __init__(self, out: TextIO, keys: Callable[[str], None]) -> None:
        self.out = out
        self._keys = keys
        self._fd: int | None = None
        self._saved: list[Any] | None = None

    def __enter__(self) -> Self:
        if sys.stdin.isatty():
            self._fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
            asyncio.get_running_loop().add_reader(self._fd, self._read)
        self.out.write(ENTER)
        self.out.flush()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.out.write(LEAVE)
        self.out.flush()
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            if self._saved is not None:
                termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def _read(self) -> None:
        assert self._fd is not None
        for key in os.read(self._fd, 64).decode(errors="replace"):
            self._keys(key)

    def draw(self, lines: list[str]) -> None:
        """Home, each line over the last frame's (the rest of it erased), then clear below."""
        self.out.write("\x1b[H" + "".join(line + "\x1b[K\r\n" for line in lines) + "\x1b[J")
        self.out.flush()


async def run_top(url: str, admin_key: str | None, interval_s: float, once: bool) -> int:
    """`narwhal top`: 0 on a clean quit; with `once`, 1 if the router could not be read."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    timeout = aiohttp.ClientTimeout(total=max(2.0, 2 * interval_s))
    async with aiohttp.ClientSession(timeout=timeout) as http:
        if once:
            state, error = await fetch(http, url, headers)
            width = shutil.get_terminal_size().columns
            frame = render(state, width, url=url, clock=_clock(), error=error, keys=False)
            try:
                sys.stdout.write("\n".join(frame) + "\n")
                sys.stdout.flush()
            except BrokenPipeError:
                # A reader that stopped early (`| head`): nothing more is wanted.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0 if error is None else 1
        await _loop(http, url, headers, interval_s)
    return 0


async def _loop(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], interval_s: float
) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    history = FailureHistory()
    state: dict[str, Any] | None = None
    before: dict[str, dict[str, int]] | None = None

    def key(pressed: str) -> None:
        if pressed in ("q", "Q", "\x03"):
            done.set()

    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, done.set)
    try:
        with Screen(sys.stdout, key) as screen:
            while not done.is_set():
                fresh, error = await fetch(http, url, headers)
                if fresh is not None:
                    state = fresh
                    before = history.add(fresh, time.monotonic())
                size = shutil.get_terminal_size()
                lines = render(
                    state, size.columns, url=url, clock=_clock(), before=before, error=error
                )
                screen.draw(lines[: size.lines - 1])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), interval_s)
    finally:
        for number in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(number)


def _clock() -> str:
    return time.strftime("%H:%M:%S")

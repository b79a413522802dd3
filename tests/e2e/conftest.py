"""The end-to-end tests' browser: Debian's chromium under Playwright."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Browser, Error, async_playwright

# Headless, and none of the background connections a closed network refuses.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Debian's chromium under Playwright; skips only where that browser cannot start."""
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("no chromium on PATH (make test installs it with apt-get where it can)")
    async with async_playwright() as playwright:
        try:
            launched = await playwright.chromium.launch(
                executable_path=executable, args=CHROMIUM_ARGS
            )
        except Error as error:
            pytest.skip(f"chromium is installed but cannot start here: {error.message[:300]}")
        try:
            yield launched
        finally:
            await launched.close()

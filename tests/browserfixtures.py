"""pytest fixtures for the UI tests in a real headless browser: Debian's chromium driven by Playwright.

Load it with `pytest_plugins = [..., "browserfixtures"]` after calling `skip_without_chromium()` at the top of the
test module (a machine without chromium or without the playwright package skips the module). `browser` is one
chromium per module; `page` a fresh tab per test that records dialogs and page errors, so a test can show that
nothing from a log ran. A module sets the tab's width with a `viewport_width` fixture of its own.

PYTEST_DONT_REWRITE: this module holds no assertions.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from typing import Any, Final

import pytest
import pytest_asyncio

CHROMIUM: Final = shutil.which("chromium")
LAUNCH_ARGS: Final = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def skip_without_chromium() -> None:
    """Skip the calling test module where Debian's chromium or the playwright package is missing."""
    if CHROMIUM is None:
        pytest.skip(
            "Debian's chromium is not installed (CI installs it in .ci/run; `apt-get install chromium` here)",
            allow_module_level=True,
        )
    pytest.importorskip("playwright.async_api", reason="the playwright Python package is not installed")


@pytest.fixture(scope="module")
def viewport_width() -> int:
    return 1100


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: Any, viewport_width: int) -> AsyncIterator[Any]:
    context = await browser.new_context(viewport={"width": viewport_width, "height": 900})
    tab = await context.new_page()
    tab.dialogs = []
    tab.on("dialog", lambda dialog: tab.dialogs.append(dialog.message))
    tab.errors = []
    tab.on("pageerror", lambda error: tab.errors.append(str(error)))
    try:
        yield tab
    finally:
        await context.close()

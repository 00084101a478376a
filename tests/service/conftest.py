"""Fixtures of the service's tests: headless Chromium for the pages the proxy serves (`/`, `/docs`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.browser import Browser, CannotInstall, browser, chromium_path


@pytest.fixture(scope="session")
def chromium() -> str:
    try:
        return chromium_path()
    except CannotInstall as exc:
        pytest.skip(str(exc))


@pytest.fixture
async def chrome(chromium: str, tmp_path: Path) -> AsyncIterator[Browser]:
    async with browser(chromium, tmp_path) as started:
        yield started

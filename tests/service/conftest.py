"""Fixtures of the service's tests: a headless Chromium page for the pages the proxy serves (`/`, `/docs`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.browser import Browser, browser


@pytest.fixture
async def chrome(chromium: str, tmp_path: Path) -> AsyncIterator[Browser]:
    async with browser(chromium, tmp_path) as started:
        yield started

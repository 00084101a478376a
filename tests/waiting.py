"""Waiting in a test for what happens in the background: a deadline loop, never a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(condition: Callable[[], object], failure: str, timeout_s: float = 30.0) -> None:
    """Until `condition()` holds, looking every 10 ms; `AssertionError(failure)` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(failure)
        await asyncio.sleep(0.01)

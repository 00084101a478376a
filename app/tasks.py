"""Helpers for asyncio tasks that every layer uses (it imports nothing of app/)."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait for it to end; its other exceptions are raised.

    The caller's own cancellation, if it comes while waiting, is raised, not taken for `task`'s:
    `contextlib.suppress(asyncio.CancelledError)` around the await swallows both, and a caller
    cancelled there carries on as if nothing had been asked of it (a background loop, say, that
    then never ends, and a shutdown that waits for it for ever).
    """
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise

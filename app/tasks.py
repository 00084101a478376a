"""Helpers for asyncio tasks that every layer uses (it imports nothing of app/)."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait for it to end; its other exceptions are raised.

    The caller's own cancellation, if one comes while waiting, is raised, not taken for `task`'s:
    `contextlib.suppress(asyncio.CancelledError)` around the await swallows both, and a caller
    cancelled there carries on as if nothing had been asked of it (a background loop, say, that
    then never ends, and a shutdown that waits for it for ever). A cancellation the caller is
    already handling (its `finally:` stopping its helpers, one after the other) is not one of those:
    each helper is stopped all the same.
    """
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:
            raise

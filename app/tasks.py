"""Helpers for asyncio tasks that every layer uses (it imports nothing of app/)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


def cancelling() -> bool:
    """Whether the running task is being cancelled (a `finally:` that must not wait for more)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks`, all at once, and wait for each to end; their other exceptions are raised.

    The caller's own cancellation, if one comes while waiting, is raised, not taken for a task's:
    `contextlib.suppress(asyncio.CancelledError)` around the await swallows both, and a caller
    cancelled there carries on as if nothing had been asked of it (a background loop, say, that
    then never ends, and a shutdown that waits for it for ever). Every task is cancelled before the
    first wait, so that one coming then leaves none of them running; a cancellation the caller is
    already handling (its `finally:` stopping its helpers) is not one of those.
    """
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except asyncio.CancelledError:
            if current is not None and current.cancelling() > before:
                raise


async def run_to_end(awaitable: Awaitable[T]) -> T:
    """Await `awaitable` to its end even if the caller is cancelled meanwhile, then raise that cancellation:
    for a clean-up that must not stop half-way (closing a cache's connections, writing a batch's last
    results). A cancellation of the awaitable itself is raised at once."""
    work = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(work)
            break
        except asyncio.CancelledError:
            if work.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result

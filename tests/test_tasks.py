"""`app.tasks.cancel_and_wait`: a task cancelled and waited for, the waiter's own cancellation kept."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from app.tasks import cancel_and_wait, run_to_end

APP = Path(__file__).resolve().parent.parent / "app"


async def slow_to_stop(stopping: asyncio.Event, stop: asyncio.Event) -> None:
    """A task that, once cancelled, takes until `stop` to end (a cache's writer finishing its commit)."""
    try:
        await asyncio.Event().wait()
    finally:
        stopping.set()
        await stop.wait()


async def test_a_task_cancelled_and_waited_for_ends_and_the_waiter_carries_on() -> None:
    child = asyncio.create_task(asyncio.Event().wait())
    await cancel_and_wait(child)
    assert child.cancelled()


async def test_the_waiters_own_cancellation_is_raised_not_swallowed_with_the_tasks() -> None:
    # The hang CI met: a background loop (the idle ranks' janitor) cancelled at shutdown while it closed a
    # rank's cache, which waited for its writer task, took the cancellation for the writer's, went on
    # looping, and the shutdown waited for it for ever.
    stopping, stop = asyncio.Event(), asyncio.Event()
    child = asyncio.create_task(slow_to_stop(stopping, stop))
    await asyncio.sleep(0)
    carried_on = False

    async def loop_that_closes_its_child() -> None:
        nonlocal carried_on
        await cancel_and_wait(child)
        carried_on = True

    waiter = asyncio.create_task(loop_that_closes_its_child())
    await stopping.wait()  # the waiter is waiting for the child to end
    waiter.cancel()
    stop.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not carried_on


async def test_a_cancelled_task_stops_every_helper_in_its_cleanup() -> None:
    # A batch's task cancelled at shutdown stops its saver, then its writer, in its `finally:`: the
    # cancellation it is handling there is not a new one, and must not cut the cleanup after the first.
    saver, writer = (asyncio.create_task(asyncio.Event().wait()) for _ in range(2))
    cleaned = False

    async def batch() -> None:
        nonlocal cleaned
        try:
            await asyncio.Event().wait()
        finally:
            await cancel_and_wait(saver)
            await cancel_and_wait(writer)
            cleaned = True

    running = asyncio.create_task(batch())
    await asyncio.sleep(0)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert (saver.cancelled(), writer.cancelled(), cleaned) == (True, True, True)


async def test_every_task_is_cancelled_before_the_first_is_waited_for() -> None:
    # A batch stopping its saver and writer, cancelled itself as it waited for the saver: the writer was left
    # running, past the batch's owner lock.
    stopping, stop = asyncio.Event(), asyncio.Event()
    saver = asyncio.create_task(slow_to_stop(stopping, stop))
    writer = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(cancel_and_wait(saver, writer))
    await stopping.wait()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert writer.cancelled()
    stop.set()
    with pytest.raises(asyncio.CancelledError):
        await saver


async def test_run_to_end_finishes_its_work_then_raises_the_cancellation_that_came_meanwhile() -> None:
    started, go_on = asyncio.Event(), asyncio.Event()
    done: list[str] = []

    async def clean_up() -> str:
        started.set()
        await go_on.wait()
        done.append("closed")
        return "closed"

    caller = asyncio.create_task(run_to_end(clean_up()))
    await started.wait()
    caller.cancel()
    await asyncio.sleep(0)
    assert not caller.done()  # still waiting for the clean-up
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert done == ["closed"]
    assert await run_to_end(clean_up()) == "closed"


async def test_a_task_that_fails_as_it_stops_raises_its_error() -> None:
    async def failing() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("could not stop cleanly")

    child = asyncio.create_task(failing())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="could not stop cleanly"):
        await cancel_and_wait(child)


def test_no_module_swallows_a_cancellation_around_an_await() -> None:
    """`contextlib.suppress(asyncio.CancelledError)` swallows the caller's cancellation with the task's:
    `cancel_and_wait` is the way to stop a task."""
    found = [
        str(path.relative_to(APP.parent))
        for path in APP.rglob("*.py")
        if path.name != "tasks.py" and re.search(r"suppress\([^)]*CancelledError", path.read_text())
    ]
    assert found == []

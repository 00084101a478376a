"""tests/servers.py's `serve_in_loop`: a test's ASGI app served whatever it does with the lifespan, as uvicorn
served it (the hundreds of tests with an upstream in their loop rely on it)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.servers import serve_in_loop


async def answer(send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def returns_at_once(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await answer(send)


async def takes_the_startup_then_returns(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await receive()
        return
    await answer(send)


async def speaks_the_lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await answer(send)


async def answers_the_startup_then_returns(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await receive()
        await send({"type": "lifespan.startup.complete"})
        return
    await answer(send)


@pytest.mark.parametrize(
    "app",
    [returns_at_once, takes_the_startup_then_returns, speaks_the_lifespan, answers_the_startup_then_returns],
)
async def test_an_app_is_served_and_stopped_whatever_it_does_with_the_lifespan(app: Any) -> None:
    async with serve_in_loop(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        answer = await client.get("/")
        assert (answer.status_code, answer.text) == (200, "ok")


async def test_an_app_failing_its_startup_fails_the_start() -> None:
    async def fails(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RuntimeError("no model")

    with pytest.raises(RuntimeError, match="no model"):
        async with serve_in_loop(fails):
            pass

"""Headless Chromium driven over the DevTools protocol (a websocket), for the tests of the live page.

Debian's `chromium` package; `chromium_path` installs it with apt-get where it is missing (the tests
that need it skip, saying why, only where that cannot be done). Every console error, uncaught
exception and failed load of a page is kept in `Page.errors`, every URL it asked for in `Page.requests`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect

from tests.apt import CannotInstall, installed

__all__ = ["CannotInstall", "chromium_path"]

#: Bounds every wait on the browser: far above what a page load or a 2 s poll takes.
TIMEOUT_S = 30.0

#: The live page's rank table, row by row (`Page.evaluate(ROWS)`).
ROWS = """[...document.querySelectorAll('#ranks tbody tr')].map(row => ({
    rank: Number(row.dataset.rank), done: row.querySelector('.done')?.textContent ?? row.cells[1].textContent,
    eta: row.cells[3].textContent, chunks: row.cells[4].textContent}))"""


def text_of(element_id: str) -> str:
    """The expression of an element's text on a page."""
    return f"document.getElementById({element_id!r}).textContent"


async def wait_text(page: Page, element_id: str, expected: str) -> None:
    """Until the element's text is `expected` (the page redraws every 2 s)."""
    await page.wait_for(f"{text_of(element_id)} === {json.dumps(expected)}")


def chromium_path() -> str:
    """Chromium's command, installed with apt-get if missing; `CannotInstall` says why it cannot be."""
    return installed("chromium", ["chromium"])


class Browser:
    """One headless Chromium process and its DevTools connection."""

    def __init__(self, connection: ClientConnection) -> None:
        self.connection = connection
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.pages: dict[str, Page] = {}
        self.reader = asyncio.create_task(self._read())

    async def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        message_id = next(self._ids)
        answer = self._answers[message_id] = asyncio.get_running_loop().create_future()
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        await self.connection.send(orjson.dumps(message).decode())
        return await asyncio.wait_for(answer, TIMEOUT_S)

    async def _read(self) -> None:
        async for raw in self.connection:
            message = orjson.loads(raw)
            if "id" in message:
                answer = self._answers.pop(message["id"])
                if "error" in message:
                    answer.set_exception(RuntimeError(f"DevTools: {message['error']}"))
                else:
                    answer.set_result(message.get("result", {}))
            elif (page := self.pages.get(message.get("sessionId", ""))) is not None:
                page.event(message["method"], message.get("params", {}))

    async def open(self, url: str, *, width: int = 1400, height: int = 1000) -> Page:
        """A new tab showing `url`, loaded, its console watched from the start."""
        target = await self.send("Target.createTarget", url="about:blank")
        attached = await self.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)
        page = self.pages[attached["sessionId"]] = Page(self, attached["sessionId"])
        for domain in ("Page", "Runtime", "Log", "Network"):
            await page.send(f"{domain}.enable")
        await page.send(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
        )
        await page.goto(url)
        return page


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session
        self.errors: list[str] = []
        self.requests: list[str] = []  # every URL the page asked for

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.browser.send(method, self.session, **params)

    def event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append(
                "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append("exception: " + details.get("exception", {}).get("description", details["text"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry['source']}): {entry['text']} {entry.get('url', '')}".rstrip())

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    async def evaluate(self, expression: str) -> Any:
        """The expression's value in the page (JSON-able), promises awaited."""
        answer = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in answer:
            raise RuntimeError(f"{expression!r} threw: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    async def wait_for(self, expression: str) -> Any:
        """The expression's first truthy value, evaluated every 0.1 s for up to `TIMEOUT_S`."""
        deadline = time.monotonic() + TIMEOUT_S
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never made {expression!r} true; errors: {self.errors}")
            await asyncio.sleep(0.1)
        return value

    async def screenshot(self, path: Path) -> None:
        """The whole page as a PNG, past the window's height."""
        height = await self.evaluate("document.documentElement.scrollHeight")
        width = await self.evaluate("document.documentElement.clientWidth")
        clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        shot = await self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def browser(executable: str, workdir: Path) -> AsyncIterator[Browser]:
    """Chromium, headless, with a profile in `workdir`; stopped at the end with everything it started."""
    profile = workdir / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    port_file = profile / "DevToolsActivePort"
    port_file.unlink(missing_ok=True)
    with (workdir / "chromium.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            executable,
            "--headless",
            "--no-sandbox",  # as root, Chromium refuses to start with its sandbox
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--remote-debugging-port=0",  # the port taken is written to DevToolsActivePort
            f"--user-data-dir={profile}",
            "about:blank",
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,  # its helper processes share a group, ended together
        )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
            if process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {(workdir / 'chromium.log').read_text()[-2000:]}")
            await asyncio.sleep(0.05)
        port, path = port_file.read_text().splitlines()[:2]
        async with connect(f"ws://127.0.0.1:{port}{path}", max_size=None) as connection:
            started = Browser(connection)
            try:
                yield started
            finally:
                started.reader.cancel()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.wait_for(process.wait(), TIMEOUT_S)

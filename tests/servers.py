"""Real servers on free loopback ports, inside the test's event loop or as processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from app.http.server import HTTPServer, restartable_port
from app.service.app import InferProxy, create_server
from app.service.settings import Settings
from app.tools.fake_upstream import FakeUpstream

__all__ = [
    "HTTP_SERVER",
    "fake_upstream",
    "free_port",
    "process",
    "proxy_client",
    "serve_in_loop",
    "serve_proxy",
    "wait_for_http",
]


def free_port() -> int:
    """A loopback port free now, for a server started next (another may take it first: start it soon), and
    again on it after a kill: below the ephemeral range, which other tests' servers and connections draw on."""
    return restartable_port()


def lifespan_optional(app: Any) -> Any:
    """`app`, whose lifespan is answered for it if it returns from one without a word (a test's upstream that
    speaks only HTTP), as uvicorn lets it: the messages it took are answered first, then those still to come."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)
        spoke = False
        taken: list[dict[str, Any]] = []

        async def noted_receive() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            taken.append(message)
            return message

        async def noted_send(message: dict[str, Any]) -> None:
            nonlocal spoke
            spoke = True
            await send(message)

        await app(scope, noted_receive, noted_send)
        if spoke:
            return None
        while True:
            message = taken.pop(0) if taken else await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return None

    return wrapped


@contextlib.asynccontextmanager
async def serve_in_loop(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app (a test's upstream, most often) with app.http's server on a free port, in this event
    loop; yield its URL. Not uvicorn: its shutdown sleeps 0.1 s whatever is open, which hundreds of tests
    paid at their end."""
    server = HTTPServer(lifespan_optional(app), host="127.0.0.1", port=0, shutdown_grace_s=5.0)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.shutdown()


@contextlib.asynccontextmanager
async def fake_upstream(**kwargs: Any) -> AsyncIterator[tuple[str, FakeUpstream]]:
    upstream = FakeUpstream(**kwargs)
    async with serve_in_loop(upstream) as url:
        yield url, upstream


#: The server `serve_proxy` runs when the settings do not name one: set by the `http_server` fixture
#: (tests/conftest.py), which runs a test under each of them.
HTTP_SERVER = {"name": "builtin"}


@contextlib.asynccontextmanager
async def serve_proxy(settings: Settings, app: InferProxy | None = None) -> AsyncIterator[str]:
    """`inferproxy serve`'s server in this event loop (around `app`, if given: `create_app(settings, ...)`);
    yield its URL.

    The built-in one (app.http.server, fast path included) or uvicorn: `settings.http` if given,
    else the `http_server` fixture's.
    """
    http = settings.http if "http" in settings.model_fields_set else HTTP_SERVER["name"]
    server = create_server(settings.model_copy(update={"host": "127.0.0.1", "port": 0, "http": http}), app)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.shutdown()


@contextlib.asynccontextmanager
async def proxy_client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The proxy served in-process on a loopback port (lifespan included), and an httpx client of it."""
    async with serve_proxy(settings) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client


def wait_for_http(url: str, timeout: float = 60.0) -> None:
    """Until `url` answers (a readiness wait: its deadline is far above a start-up, which on a machine busy with
    parallel tests and an object store's client to import took over 20 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`inferproxy ARGS...` run to its end (in `env`, if given: the whole environment), its output captured
    as text."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def serve_once(checkpoints: str | Path, output: str | Path) -> subprocess.CompletedProcess[str]:
    """`inferproxy serve` on `checkpoints` and `output`, for a test of how it refuses to start."""
    return run_cli(
        "serve", "--upstream=http://127.0.0.1:9", "--port=0", f"--checkpoints-dir={checkpoints}", f"--output={output}"
    )


@contextlib.contextmanager
def process(
    *args: str, env: dict[str, str] | None = None, cwd: str | None = None, read_stderr: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """`inferproxy ARGS...` as a real process; killed at the end if still running.

    Its log goes to a file, shown if the test fails (a pipe nobody reads would stop the process once
    64 KiB of log lines filled it); `read_stderr` gives the caller the pipe to read instead."""
    with contextlib.ExitStack() as stack:
        log = None if read_stderr else stack.enter_context(tempfile.TemporaryFile())
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", *args],
            env={**os.environ, **(env or {})},
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if read_stderr else log,
        )
        try:
            yield proc
        except BaseException:
            if log is not None:  # pytest shows what the test printed when it fails
                log.seek(0)
                print(f"inferproxy {' '.join(args)}: its log\n" + log.read()[-20_000:].decode(errors="replace"))
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stderr is not None:
                proc.stderr.close()

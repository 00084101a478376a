"""docs/architecture.md's ways through the code, traced: the `app/` files whose code runs for a cache hit, a
miss and a document on its way to its published chunk, in a real proxy on a loopback port (the built-in
server, its fast path included), must be the files the document lists for each, within the issue's goals.

The trace is `sys.setprofile` over the one request (or, for the document, until its chunk is published):
every Python function called in `app/` counts its file, whoever called it. The proxy's own periodic work
(a tick every few seconds, in tasks of their own) is left out.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from app.service.settings import Settings
from tests.factories import chat_request, doc_headers
from tests.servers import free_port, process, serve_proxy, wait_for_http

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"
DOC = ROOT / "docs" / "architecture.md"
#: The issue's goals: files crossed by each way, at most.
GOALS = {"hit": 5, "miss": 7, "document": 6}


#: The proxy's periodic tasks (app/service/app.py names them): not the way of any request.
PERIODIC = {"every-few-seconds", "release-idle-ranks", "probe-upstreams"}


def periodic() -> bool:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # a protocol callback, outside any task
        return False
    return task is not None and task.get_name() in PERIODIC


async def traced(work: Callable[[], Awaitable[Any]]) -> set[str]:
    """The `app/` files (relative to the repo) whose functions ran while `work` was awaited."""
    files: set[str] = set()
    prefix = str(APP) + "/"

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(prefix) and not periodic():
                files.add(name[len(str(ROOT)) + 1 :])

    sys.setprofile(profile)
    try:
        await work()
    finally:
        sys.setprofile(None)
    return files


def documented() -> dict[str, tuple[set[str], str]]:
    """Each way's files as docs/architecture.md lists them (the backquoted `app/...` paths of its section,
    up to its "What stands between"), and the section's first line (its count)."""
    ways: dict[str, tuple[set[str], str]] = {}
    text = DOC.read_text() + "\n#"
    for way in GOALS:
        section = re.search(
            rf"^### The way of a {way}\n\n(.*?)(?=^What stands between|^#)", text, re.MULTILINE | re.DOTALL
        )
        assert section is not None, f"{DOC} has no '### The way of a {way}' section"
        body = section.group(1)
        ways[way] = (set(re.findall(r"`(app/[\w/]+\.py)`", body)), body.split("\n", 1)[0])
    return ways


def settings(tmp_path: Path, upstream: str) -> Settings:
    return Settings(
        upstream=[upstream],
        checkpoints_dir=tmp_path / "ckpt",
        output=str(tmp_path / "out"),
        records_per_chunk=1,
        http="builtin",
    )


async def trace_ways(tmp_path: Path) -> dict[str, set[str]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the upstream in its own process: it runs app/http's server too, which would count in this one
    with process("fake-upstream", f"--port={port}"):
        await asyncio.to_thread(wait_for_http, f"{url}/v1/models")
        return await trace_ways_through(tmp_path, url)


async def trace_ways_through(tmp_path: Path, url: str) -> dict[str, set[str]]:
    ways: dict[str, set[str]] = {}
    body = chat_request()
    async with serve_proxy(settings(tmp_path, url)) as proxy, httpx.AsyncClient(base_url=proxy, timeout=30) as client:
        await client.get("/healthz")  # the connection is open before the traces

        async def post(doc_id: str) -> None:
            answer = await client.post("/v1/chat/completions", json=body, headers=doc_headers(doc_id))
            answer.raise_for_status()

        await post("warm")  # the first miss's one-off work (a rank opened) is not the way of a miss
        ways["miss"] = await traced(lambda: post("a"))
        ways["hit"] = await traced(lambda: post("a"))

        async def publish() -> None:
            document = {"id": "d", "text": "a finished document"}
            answer = await client.post("/documents", json=document, headers={"X-Chunk-Index": "0"})
            answer.raise_for_status()
            deadline = time.monotonic() + 30
            while not any((tmp_path / "out").glob("*")):
                assert time.monotonic() < deadline, "the chunk was never published"
                await asyncio.sleep(0.01)

        await client.get("/resume")  # the rank's checkpoints open before the trace
        ways["document"] = await traced(publish)
    return ways


async def test_each_way_crosses_the_files_docs_architecture_lists_within_the_goals(tmp_path: Path) -> None:
    ways = await trace_ways(tmp_path)
    listed = documented()
    for way, files in ways.items():
        paths, count = listed[way]
        assert files == paths, f"the way of a {way} crosses {sorted(files)}; {DOC.name} lists {sorted(paths)}"
        packages = {path.rsplit("/", 1)[0] for path in files}
        assert count.startswith(f"{len(files)} files (goal: {GOALS[way]}) in {len(packages)} packages."), (way, count)

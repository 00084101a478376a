"""File descriptors: the connection cap, the body deadline, and a rank that cannot be opened for want of files.

The proxies whose open files are limited run as processes (`resource.setrlimit` in the child), so
that the test process keeps its own limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import resource
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.service.limits import default_max_connections
from app.service.settings import Settings
from app.store.cache import RequestCache
from app.store.layout import CheckpointsLayout
from app.store.ownership import RankOwnership
from tests.factories import chat_request, doc_headers
from tests.http.test_server import App, Conn, get, post, serving
from tests.http.test_server_limits import big_fast, response_while_trickling
from tests.servers import fake_upstream, free_port, proxy_client, serve_proxy, wait_for_http

# -- the connection cap --------------------------------------------------------------


async def test_past_max_connections_a_new_connection_gets_503_at_once_and_those_open_are_served() -> None:
    async with serving(App(), max_connections=5) as server:
        admitted = [await Conn.open(server) for _ in range(5)]
        for conn in admitted:  # each accepted and served before the next ones come
            await conn.send(get("/echo"))
            assert (await conn.response())[0] == 200
        for _ in range(3):
            turned_away = await Conn.open(server)  # sends nothing: the answer comes all the same
            status, headers, body = await turned_away.response()
            assert (status, headers[b"retry-after"], headers[b"connection"]) == (503, b"1", b"close")
            assert b"max_connections" in body
            assert await turned_away.closed_by_server()
        for conn in admitted:
            await conn.send(post("/echo", b"still served"))
            assert (await conn.response())[2] == b"still served"
        leaving = admitted.pop()
        await leaving.send(get("/echo", "Connection: close"))
        assert (await leaving.response())[0] == 200
        assert await leaving.closed_by_server()  # the server closed it: one place is free
        again = await Conn.open(server)
        await again.send(get("/echo"))
        assert (await again.response())[0] == 200
        for conn in [*admitted, again]:
            conn.close()


async def test_under_uvicorn_max_connections_turns_away_a_request_past_it(tmp_path: Path) -> None:
    settings = Settings(upstream=["http://127.0.0.1:9"], checkpoints_dir=tmp_path, http="uvicorn", max_connections=5)
    async with serve_proxy(settings) as url:
        port = int(url.rsplit(":", 1)[1])
        opened = []
        for _ in range(5):
            opened.append(Conn(*await asyncio.open_connection("127.0.0.1", port)))
            await opened[-1].send(get("/healthz"))
            assert (await opened[-1].response())[0] == 200
        opened.append(Conn(*await asyncio.open_connection("127.0.0.1", port)))
        await opened[-1].send(get("/healthz"))
        assert (await opened[-1].response())[0] == 503
        for conn in opened:
            conn.close()


def test_the_connection_limits_in_the_settings_reach_both_servers(tmp_path: Path) -> None:
    from app.http.server import HTTPServer
    from app.service.app import create_server
    from app.service.uvicorn_server import UvicornServer

    settings = Settings(checkpoints_dir=tmp_path, body_timeout_s=12.5, max_connections=7)
    builtin = create_server(settings)
    assert isinstance(builtin, HTTPServer)
    assert (builtin.body_timeout_s, builtin.max_connections) == (12.5, 7)
    uvicorn = create_server(settings.model_copy(update={"http": "uvicorn"}))
    assert isinstance(uvicorn, UvicornServer)
    assert uvicorn.config.limit_concurrency == 7 + 1  # uvicorn counts the connection asking


def test_the_default_max_connections_is_what_the_open_files_limit_leaves_after_the_ranks() -> None:
    assert default_max_connections(max_open_ranks=100, limit=65536) == (65536 - 64 - 800) // 2
    assert default_max_connections(max_open_ranks=256, limit=1024) == 64  # the floor


# -- the body deadline -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "path"),
    [({}, "/echo"), ({"fast": big_fast, "fast_paths": ["/fast"]}, "/fast")],
    ids=["ASGI app", "fast path"],
)
async def test_a_body_trickled_byte_by_byte_is_refused_with_408_once_its_deadline_passes(
    options: dict[str, Any], path: str
) -> None:
    app = App()
    async with serving(app, keep_alive_s=0.05, body_timeout_s=0.3, **options) as server:
        conn = await Conn.open(server)
        await conn.send(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n".encode())
        status, headers, body = await response_while_trickling(conn)
        assert (status, headers[b"connection"]) == (408, b"close")
        assert b"body was not complete within 0.3 s" in body
        conn.close()


# -- a rank that cannot be opened for want of files -------------------------------------


async def test_a_rank_whose_cache_cannot_be_opened_for_want_of_files_gets_503_and_is_left_unclaimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opening = RequestCache.initialize

    async def out_of_files(self: RequestCache, rank: int) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    async with fake_upstream() as (url, _):
        settings = Settings(upstream=[url], checkpoints_dir=tmp_path, retry_backoff_s=0.001)
        async with proxy_client(settings) as client:
            monkeypatch.setattr(RequestCache, "initialize", out_of_files)
            refused = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers(**RANK_8))
            assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
            message = refused.json()["error"]["message"]
            assert "out of file descriptors" in message
            assert all(name in message for name in ("ulimit -n", "max_open_ranks", "max_connections"))
            # Nothing of the rank stays claimed: another proxy could take it now.
            elsewhere = RankOwnership(CheckpointsLayout(str(tmp_path)))
            elsewhere.claim(8)
            elsewhere.release(8)
            monkeypatch.setattr(RequestCache, "initialize", opening)
            served = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers(**RANK_8))
            assert (served.status_code, served.headers["x-cache"]) == (200, "MISS")


RANK_8 = {"X-Rank": "8"}


async def test_short_of_file_descriptors_a_new_rank_closes_the_least_recently_used_idle_one_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import app.service.services

    async with fake_upstream() as (url, _):
        settings = Settings(upstream=[url], checkpoints_dir=tmp_path, retry_backoff_s=0.001, max_open_ranks=100)
        async with proxy_client(settings) as client:
            for rank in (1, 2, 3):  # opened in this order: rank 1 is the least recently used
                answer = await client.post(
                    "/v1/chat/completions", json=chat_request(), headers=doc_headers(**{"X-Rank": str(rank)})
                )
                assert answer.status_code == 200
            monkeypatch.setattr(app.service.services, "files_short_for_a_rank", lambda: True)
            opened = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers(**RANK_8))
            assert opened.status_code == 200
            ranks = (await client.get("/stats")).json()["owned_ranks"]
            # At most FILES_EVICTIONS idle ranks closed, least recently used first; far below max_open_ranks.
            assert ranks == [3, 8]
            monkeypatch.setattr(app.service.services, "files_short_for_a_rank", lambda: False)
            replayed = await client.post(
                "/v1/chat/completions", json=chat_request(), headers=doc_headers(**{"X-Rank": "1"})
            )
            assert (replayed.status_code, replayed.headers["x-cache"]) == (200, "HIT")  # reopened with its answers


@contextlib.contextmanager
def limited_proxy(tmp_path: Path, upstream: str, open_files: int, *flags: str) -> Iterator[int]:
    """`inferproxy serve` as a process whose open files are limited to `open_files`; yield its port."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    port = free_port()
    args = [f"--port={port}", f"--upstream={upstream}", f"--checkpoints-dir={tmp_path / 'ckpt'}"]
    log = tmp_path / "proxy.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", *args, f"--output={tmp_path / 'out'}", *flags],
            preexec_fn=limit,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(log.read_text()[-4000:])  # shown when the test fails


async def chat(conn: Conn) -> tuple[int, dict[bytes, bytes], bytes]:
    body = orjson.dumps(chat_request())
    headers = [f"{name}: {value}" for name, value in doc_headers(**RANK_8).items()]
    await conn.send(post("/v1/chat/completions", body, "Content-Type: application/json", *headers))
    return await conn.response()


@contextlib.asynccontextmanager
async def connections(port: int, count: int) -> AsyncIterator[list[Conn]]:
    """`count` connections, each holding a request head part-way (neither idle nor stalled for 30 s)."""
    opened: list[Conn] = []
    try:
        for _ in range(count):
            with contextlib.suppress(OSError):
                conn = Conn(*await asyncio.open_connection("127.0.0.1", port))
                opened.append(conn)
                conn.writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        await asyncio.sleep(0.5)  # the proxy accepts what it can
        yield opened
    finally:
        for conn in opened:
            conn.close()


async def probe(port: int) -> Conn:
    """A connection the proxy has accepted and served already."""
    conn = Conn(*await asyncio.open_connection("127.0.0.1", port))
    await conn.send(get("/healthz"))
    assert (await conn.response())[0] == 200
    return conn


async def test_out_of_file_descriptors_a_new_rank_gets_503_and_is_served_once_files_are_free(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _):
        # A connection cap above what the limit holds: the connections take every descriptor.
        with limited_proxy(tmp_path, url, 128, "--max-connections=1000") as port:
            await asyncio.to_thread(wait_for_http, f"http://127.0.0.1:{port}/healthz")
            conn = await probe(port)
            async with connections(port, 200):
                status, headers, body = await chat(conn)
                assert (status, headers[b"retry-after"]) == (503, b"1"), body
                assert b"ulimit -n" in body
                # Nothing of the rank was left claimed.
                elsewhere = RankOwnership(CheckpointsLayout(str(tmp_path / "ckpt")))
                elsewhere.claim(8)
                elsewhere.release(8)
            async with asyncio.timeout(10):
                while True:  # once the connections are gone, the same request is served
                    status, headers, body = await chat(conn)
                    if status != 503:
                        break
                    await asyncio.sleep(0.1)
            assert (status, headers[b"x-cache"]) == (200, b"MISS"), body
            conn.close()


async def test_with_the_default_connection_cap_connections_past_it_are_turned_away_and_ranks_still_open(
    tmp_path: Path,
) -> None:
    # 256 files, 4 ranks: the default cap is (256 - 64 - 32) // 2 = 80 connections.
    async with fake_upstream() as (url, _):
        with limited_proxy(tmp_path, url, 256, "--max-open-ranks=4") as port:
            await asyncio.to_thread(wait_for_http, f"http://127.0.0.1:{port}/healthz")
            conn = await probe(port)
            async with connections(port, 200) as opened:
                seen: list[str] = []
                for other in opened:
                    try:
                        async with asyncio.timeout(0.05):
                            seen.append(str((await other.response())[0]))
                    except TimeoutError:
                        seen.append("admitted")
                    except (asyncio.IncompleteReadError, ConnectionError):
                        seen.append("dropped")  # turned away past those that may linger for their 503
                assert seen.count("admitted") == 80 - 1  # the probe is one of them
                assert seen.count("503") >= 1
                assert set(seen) <= {"admitted", "503", "dropped"}
                status, headers, body = await chat(conn)
                assert (status, headers[b"x-cache"]) == (200, b"MISS"), body
            conn.close()

"""`inferproxy status`: a real proxy's numbers in the terminal, once or refreshing under a pty."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from app.cli import main
from app.tools import status
from tests.e2e.conftest import running_upstream, start_proxy
from tests.jobs import proxy_finding_chunks_lost, publish_chunks, run_rank, settings, write_chunks
from tests.servers import fake_upstream, free_port, process, serve_proxy, wait_for_http


async def inferproxy_status(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`inferproxy status ARGS` as a process (not a terminal), without blocking the loop the proxy runs in."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.cli",
        "status",
        *args,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_one_rank_without_a_declared_total_is_one_rank() -> None:
    # What `inferproxy status` shows after the README's first request through the proxy.
    rank: Any = {"done_documents": None, "total_documents": None}
    assert status._documents_done([rank]) == "documents done 0 on 1 rank (totals declared by 0)"
    assert status._documents_done([rank, rank]) == "documents done 0 on 2 ranks (totals declared by 0)"


async def test_once_shows_each_ranks_progress_and_the_hit_ratio_of_stats(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        await run_rank(proxy, 0, 12, total=12, cached=4)
        await run_rank(proxy, 1, 8, total=20)
        await run_rank(proxy, 2, 3)
        async with httpx.AsyncClient(base_url=proxy) as client:
            stats = (await client.get("/stats")).json()
        code, out, err = await inferproxy_status(proxy, "--once")
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[0].startswith(f"inferproxy {stats['version']} at {proxy} · up ")
        assert f"hit ratio {status.percent(stats['totals']['hit_ratio'])} · " in out
        assert f"tokens saved {status.count(stats['totals']['tokens_saved'])} · generations saved 4 · " in out
        # Rank 2 declared nothing, but finished: its total is known now (rank 1 runs on, 8 of 20).
        done = next(line for line in lines if line.startswith("documents done"))
        assert done.startswith("documents done 23 / 35 (65.7%) · ETA ")  # rank 1's
        assert done.endswith(" · 2 of 3 ranks seen finished")
        assert (
            "job: 2 ranks finished, of a number it did not declare (X-Total-Ranks): whether it is done is not known"
            in lines
        )
        rows = {line.split()[0]: line for line in lines if line[:1].isdigit()}
        assert set(rows) == {"0", "1", "2"}
        assert "[####################] 12 / 12 · 100.0%" in rows["0"]
        assert "[########............] 8 / 20 · 40.0%" in rows["1"]
        assert "[####################] 3 / 3 · 100.0%" in rows["2"]
        assert rows["2"].split("100.0%")[1].split()[1] == "finished"
        assert "finished" not in rows["1"]
        assert any(line.startswith(url) and "healthy" in line for line in lines)

        # Not a terminal: one snapshot, as with --once; --json is /stats itself; --sort orders the ranks.
        code, out, _ = await inferproxy_status(proxy, "--sort", "progress")
        assert code == 0
        assert [line.split()[0] for line in out.splitlines() if line[:1].isdigit()] == ["1", "0", "2"]
        code, out, _ = await inferproxy_status(proxy.removeprefix("http://"), "--json")
        assert code == 0
        assert json.loads(out)["totals"]["hits"] == stats["totals"]["hits"] == 4

    # Hundreds of ranks on a terminal of 30 lines: as many as fit, and a line saying how many more.
    many = {**stats, "ranks": [{**stats["ranks"][1], "rank": r} for r in range(300)]}
    lines = status.render(many, proxy, height=30)
    assert len(lines) == 30
    # (19: the job's line is one of the head's)
    assert [line.split()[0] for line in lines if line[:1].isdigit()] == [str(r) for r in range(19)]
    assert "… 281 more ranks (--sort progress: least done first; --once: all)" in lines
    assert lines[-1].startswith(url)  # the replicas stay in view


async def test_a_proxy_with_an_api_key_takes_it_from_the_flag_or_the_environment(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url, api_key="sekrit")) as proxy:
        code, out, err = await inferproxy_status(proxy, "--once", env={"INFERPROXY_API_KEY": ""})
        assert (code, out) == (1, "")
        assert err == f"inferproxy status: {proxy} needs its API key (401): pass --api-key or set INFERPROXY_API_KEY\n"
        code, _, err = await inferproxy_status(proxy, "--once", "--api-key", "wrong")
        assert (code, err) == (1, f"inferproxy status: {proxy} refused the API key given (401)\n")
        code, out, _ = await inferproxy_status(proxy, "--once", "--api-key", "sekrit")
        assert code == 0
        assert out.startswith("inferproxy ")
        code, out, _ = await inferproxy_status(proxy, "--once", env={"INFERPROXY_API_KEY": "sekrit"})
        assert code == 0
        assert "no job yet" in out


#: What status says of a key no HTTP header can carry.
KEY_REFUSED = (
    "inferproxy status: the API key given (--api-key or INFERPROXY_API_KEY) holds a control character "
    "(a line break?): a key is one line of text\n"
)


async def test_a_key_with_a_line_break_is_refused_at_once_in_one_line() -> None:
    # It was "cannot reach URL: the header b'authorization' has a CR, LF...": it is the key that is wrong.
    async with answering(answer(orjson.dumps(STATS))) as (url, heads):
        for key in ("sek\nrit", "sek\r\nrit", "sek\x00rit", "sek\x7frit"):
            assert await status_of(url, "--api-key", key) == (2, "", KEY_REFUSED), repr(key)
    assert heads == []


def test_a_key_with_a_line_break_is_refused_at_once_on_a_terminal_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # Redrawing as well: refused before the first frame, and not tried again (no try can send it).
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def redrawn(seconds: float) -> None:
        raise AssertionError("redrawn and waiting to try again, not refused")

    monkeypatch.setattr(status.time, "sleep", redrawn)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = status.main(
            f"http://127.0.0.1:{free_port()}", api_key="sek\nrit", once=False, raw=False, sort="rank", out=Terminal()
        )
    assert (code, err.getvalue()) == (2, KEY_REFUSED)


async def test_an_unreachable_proxy_is_one_line_and_exit_code_1() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    code, out, err = await inferproxy_status(dead, "--once")
    assert (code, out) == (1, "")
    assert err.startswith(f"inferproxy status: cannot reach {dead}: ")
    assert len(err.splitlines()) == 1


async def test_the_v1_base_url_given_for_the_proxys_root_says_which_url_to_give(tmp_path: Path) -> None:
    # It said "GET .../v1/stats answered 404: is .../v1 an inferproxy?", as of something that is not one.
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        for given in (f"{proxy}/v1", f"{proxy}/v1/"):
            code, out, err = await status_of(given)
            assert (code, out) == (1, ""), given
            assert err == (
                f"inferproxy status: GET {proxy}/v1/stats answered 404: status takes the proxy's root, "
                f"not the /v1 base_url: try {proxy}\n"
            ), given
        code, out, _ = await status_of(proxy)
        assert code == 0


def read_until(master: int, wanted: bytes, output: bytearray, times: int = 1) -> None:
    """Read the pty until `wanted` has appeared `times` times in all that was read, or the terminal is closed."""
    deadline = time.monotonic() + 30
    while output.count(wanted) < times:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"never saw {wanted!r} {times} times in {bytes(output)[-2000:]!r}"
        if not select.select([master], [], [], remaining)[0]:
            continue
        try:
            read = os.read(master, 65536)
        except OSError:  # EIO: the process has ended and closed the terminal
            return
        if not read:
            return
        output += read


def test_on_a_terminal_it_redraws_says_when_the_proxy_is_gone_and_stops_quietly_on_ctrl_c(tmp_path: Path) -> None:
    with running_upstream() as upstream:
        args, port = start_proxy(upstream.url, tmp_path)
        proxy = f"http://127.0.0.1:{port}"
        with process(*args) as served:
            wait_for_http(proxy + "/healthz")
            master, terminal = pty.openpty()
            watcher = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "status", proxy],
                stdout=terminal,
                stderr=subprocess.PIPE,
                env={**os.environ, "COLUMNS": "120", "LINES": "40"},
            )
            os.close(terminal)
            output = bytearray()
            try:
                read_until(master, status.CLEAR.encode(), output, times=2)
                frames = bytes(output).decode().split(status.CLEAR)[1:]
                assert len(frames) >= 2
                assert all(frame.startswith(f"inferproxy 0.1.0 at {proxy} · up ") for frame in frames)
                served.terminate()
                served.wait(timeout=30)
                read_until(master, b"disconnected, retrying every 2 s: cannot reach", output)
                watcher.send_signal(signal.SIGINT)
                # The rest, up to the closed terminal, read as it comes: a terminal nobody reads blocks the
                # watcher's last write, and it would never end.
                read_until(master, b"never printed", output)
                assert watcher.wait(timeout=30) == 0
                assert watcher.stderr is not None
                assert watcher.stderr.read() == b""
            finally:
                if watcher.poll() is None:
                    watcher.kill()
                    watcher.wait()
                os.close(master)
                if watcher.stderr is not None:
                    watcher.stderr.close()
        # The last frame kept the numbers under the line that says the proxy is gone.
        last = bytes(output).decode().split(status.CLEAR)[-1]
        assert last.splitlines()[1].startswith(f"inferproxy 0.1.0 at {proxy}")


COUNTS = [
    (None, "—"),
    (0, "0"),
    (999, "999"),
    (999.5, "1k"),
    (1000, "1k"),
    (1234, "1.2k"),
    (1250, "1.3k"),  # halves up, as the page's JavaScript rounds them
    (99_949, "99.9k"),
    (99_960, "100k"),
    (999_400, "999k"),
    (999_950, "1M"),
    (3_400_000, "3.4M"),
    (12_345_678_901, "12.3G"),
]


@pytest.mark.parametrize(("value", "text"), COUNTS)
def test_counts_keep_three_figures(value: int | None, text: str) -> None:
    assert status.count(value) == text


def test_durations_rates_and_latencies_read_as_a_person_says_them() -> None:
    assert [status.duration(s) for s in (0, 42.4, 125, 7380, 90_000, None)] == [
        "0s",
        "42s",
        "2m 05s",
        "2h 03m",
        "1d 01h",
        "—",
    ]
    assert [status.rate(r) for r in (0, 0.421, 12.34, 99.96, 1234.0)] == ["0.00", "0.42", "12.3", "100", "1.2k"]
    assert [status.latency(s) for s in (0.025, 0.9996, 2.5, None)] == ["25 ms", "1 s", "2.5 s", "—"]
    assert [status.percent(r) for r in (0.1235, 1.0, None)] == ["12.4%", "100.0%", "—"]
    assert status.size(4_500_000) == "4.5MB"


# -- whatever answers at the URL ------------------------------------------------------------------

#: What `render` reads of /stats, as a proxy answers it with nothing yet.
STATS: dict[str, Any] = {
    "version": "0.1.0",
    "now": 1_700_000_000.0,
    "uptime_s": 12.0,
    "totals": {"hits": 0, "coalesced": 0, "tokens_saved": 0, "hit_ratio": None},
    "rates": {"requests_per_s": None, "documents_per_s": None},
    "in_flight": 0,
    "upstreams": [
        {
            "url": "http://127.0.0.1:8000",
            "healthy": True,
            "in_flight": 0,
            "requests": 0,
            "errors": 0,
            "retries": 0,
            "latency_p50_s": None,
            "latency_p99_s": None,
        }
    ],
    "ranks": [],
}
RANK: dict[str, Any] = {
    "rank": 0,
    "hits": 0,
    "coalesced": 0,
    "misses": 0,
    "tokens_saved": 0,
    "chunks_published": 0,
    "done_documents": 5,
    "total_documents": 10,
    "progress": 0.5,
    "documents_per_s": 1.0,
    "eta_s": 5.0,
}

#: A batch as /stats has it while it runs (`progress()` of app/service/batches/engine.py), paused.
BATCH: dict[str, Any] = {
    "id": "batch_0123",
    "status": "in_progress",
    "total": 2000,
    "completed": 480,
    "failed": 20,
    "in_flight": 16,
    "usage": {"input_tokens": 10, "output_tokens": 20, "total_tokens": 30},
    "hits": 7,
    "lines_per_s": 12.5,
    "eta_s": 120.0,
    "paused": "the checkpoints disk is full (No space left on device): free space under /ckpt",
}

Handler = Callable[[asyncio.StreamWriter], Awaitable[None]]


def answer(body: bytes, status: str = "200 OK", *headers: str) -> Handler:
    async def send(writer: asyncio.StreamWriter) -> None:
        head = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", *headers, "Connection: close", "", ""]
        writer.write("\r\n".join(head).encode() + body)
        await writer.drain()

    return send


async def trickle(writer: asyncio.StreamWriter) -> None:
    """A body of 100 kB sent a byte at a time, every 0.2 s: never silent long enough for a read timeout."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while True:
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def answering(handler: Handler, host: str = "127.0.0.1") -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server on a free port of `host` answering every request with `handler`; yields its URL and the
    heads of the requests it was sent."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            await handler(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up
        finally:
            writer.close()

    server = await asyncio.start_server(serve, host, 0)
    try:
        yield f"http://{host}:{server.sockets[0].getsockname()[1]}", heads
    finally:
        server.close()


async def status_of(url: str, *args: str) -> tuple[int, str, str]:
    """`inferproxy status URL --once ARGS` in this process (off the event loop the servers run in)."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return main(["status", url, "--once", *args])

    code = await asyncio.to_thread(run)
    return code, out.getvalue(), err.getvalue()


async def test_a_fragment_in_the_url_is_dropped_and_a_query_refused_before_any_request() -> None:
    # /stats went after them, into the fragment or the query: `URL#top` and `URL?x=1` fetched the page at /.
    async with answering(answer(orjson.dumps(STATS))) as (url, heads):
        for given in (f"{url}#top", f"{url}/#top", f"{url}/prefix/#top/x"):
            code, out, err = await status_of(given)
            assert (code, err) == (0, ""), given
            assert out.startswith("inferproxy 0.1.0 at "), given
        assert [head.split(b"\r\n")[0] for head in heads] == [
            b"GET /stats HTTP/1.1",
            b"GET /stats HTTP/1.1",
            b"GET /prefix/stats HTTP/1.1",
        ]
        for given, root in ((f"{url}?x=1", url), (f"{url}/prefix/?x=1#top", f"{url}/prefix/")):
            code, out, err = await status_of(given)
            assert (code, out) == (2, ""), given
            assert err == (
                f"inferproxy status: {root}?x=*** has a query: status takes the proxy's root URL and asks "
                f"its /stats, which takes none: try {root}\n"
            )
        assert len(heads) == 3  # nothing asked
    assert await status_of("http://[::1") == (2, "", "inferproxy status: http://[::1 is no URL: Invalid IPv6 URL\n")


async def test_credentials_in_the_url_are_shown_as_stars_as_in_the_proxys_logs() -> None:
    # The header line said "inferproxy 0.1.0 at http://user:hunter2@127.0.0.1:PORT" (an attack run).
    async with answering(answer(orjson.dumps(STATS))) as (url, _), answering(answer(b"<html>")) as (page, _):
        code, out, err = await status_of(url.replace("://", "://user:hunter2@"))
        assert (code, err) == (0, "")
        assert out.startswith(f"inferproxy 0.1.0 at {url.replace('://', '://***@')} · up 12s")
        code, out, err = await status_of(url.replace("http://", "user:hunter2@"))  # host:port, taken as http
        assert out.startswith(f"inferproxy 0.1.0 at {url.replace('http://', '***@')} · up 12s")
        _, _, err = await status_of(page.replace("://", "://user:hunter2@"))
        assert err.startswith(f"inferproxy status: {page.replace('://', '://***@')} did not answer with inferproxy's")
    dead = f"http://user:hunter2@127.0.0.1:{free_port()}"
    _, _, err = await status_of(dead)
    assert err.startswith(f"inferproxy status: cannot reach {dead.replace('user:hunter2', '***')}: ")
    _, _, err = await status_of(dead + "/?token=hunter2")
    assert err.startswith(f"inferproxy status: {dead.replace('user:hunter2', '***')}/?token=*** has a query: ")
    assert "hunter2" not in err


async def test_a_redirect_is_not_followed_and_the_api_key_goes_nowhere_else() -> None:
    # urllib followed it, sending "Authorization: Bearer KEY" to whatever host the answer named.
    async with answering(answer(orjson.dumps(STATS)), host="127.0.0.2") as (elsewhere, taken):
        to = f"{elsewhere}/stats"
        async with answering(answer(b"", "302 Found", f"Location: {to}")) as (url, asked):
            code, out, err = await status_of(url, "--api-key", "sekrit")
    assert (code, out) == (1, "")
    assert err == (
        f"inferproxy status: GET {url}/stats answered 302, a redirect to {to}: not followed (the API key would go "
        f"along); give the proxy's own URL\n"
    )
    assert b"authorization: Bearer sekrit" in asked[0]
    assert taken == []


NOT_STATS = {
    "html": (b"<html><body>hi</body></html>", "not JSON (unexpected character"),
    "a list": (b"[1, 2, 3]", "the answer is a list, not an object"),
    "totals only": (b'{"totals": {}}', "version is missing"),
    "wrong types": (orjson.dumps({**STATS, "totals": "abc"}), 'totals is "abc", not an object'),
    "a number as text": (orjson.dumps({**STATS, "uptime_s": "12"}), 'uptime_s is "12", not a number >= 0'),
    "a rank's progress": (
        orjson.dumps({**STATS, "ranks": [{**RANK, "progress": "x"}]}),
        'ranks[0].progress is "x", not a number >= 0 or null',
    ),
    "a negative progress": (
        orjson.dumps({**STATS, "ranks": [RANK, {**RANK, "rank": 1, "progress": -5}]}),
        "ranks[1].progress is -5, not a number >= 0 or null",
    ),
    "forgotten ranks as text": (
        orjson.dumps({**STATS, "forgotten": {"ranks": "4"}}),
        'forgotten.ranks is "4", not a number >= 0 or null',
    ),
    "invalid UTF-8": (orjson.dumps({**STATS, "version": "v"}).replace(b'"v"', b'"\xff\xfe"'), "not JSON (str is not"),
    "chunks waiting as text": (
        orjson.dumps({**STATS, "ranks": [{**RANK, "chunks_waiting": "2"}]}),
        'ranks[0].chunks_waiting is "2", not a number >= 0',
    ),
    "a publication error as a number": (
        orjson.dumps({**STATS, "ranks": [{**RANK, "publication_error": 5}]}),
        "ranks[0].publication_error is 5, not text or null",
    ),
    "lost chunks as text": (
        orjson.dumps({**STATS, "ranks": [{**RANK, "chunks_lost": "0, 2"}]}),
        'ranks[0].chunks_lost is "0, 2", not a list',
    ),
    "a lost chunk as text": (
        orjson.dumps({**STATS, "ranks": [{**RANK, "chunks_lost": [0, "2"]}]}),
        'ranks[0].chunks_lost[1] is "2", not an integer',
    ),
    # Each of these three was a traceback (an attack run): the shape did not say what the display reads of them.
    "a batch's hits as text": (
        orjson.dumps({**STATS, "batches": [{**BATCH, "hits": "x"}]}),
        'batches[0].hits is "x", not a number >= 0',
    ),
    "why a batch is paused as a number": (
        orjson.dumps({**STATS, "batches": [{**BATCH, "paused": 5}]}),
        "batches[0].paused is 5, not text or null",
    ),
    "the routing as a number": (
        orjson.dumps({**STATS, "routing": 5, "upstreams": STATS["upstreams"] * 2}),
        "routing is 5, not text",
    ),
}


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
@pytest.mark.parametrize(("body", "wrong"), NOT_STATS.values(), ids=NOT_STATS.keys())
async def test_an_answer_that_is_not_stats_is_one_line_saying_what_is_wrong(
    body: bytes, wrong: str, as_json: bool
) -> None:
    # Each was a traceback, or (--json) printed as it came with exit code 0.
    async with answering(answer(body)) as (url, _):
        code, out, err = await status_of(url, *(["--json"] if as_json else []))
    assert (code, out) == (1, "")
    assert err.startswith(f"inferproxy status: {url} did not answer with inferproxy's /stats: {wrong}")
    assert err.count("\n") == 1


#: A value of each JSON type, and the key taken away.
OTHER_VALUES: list[Any] = ["x", 7, 2.5, True, None, ["x"], {"x": 1}]
MISSING = object()


def kind(value: Any) -> str:
    return "number" if isinstance(value, int | float) and not isinstance(value, bool) else type(value).__name__


def paths(value: Any, at: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """The path of every key and list item in `value`, at every depth."""
    inner = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in inner:
        yield (*at, key)
        yield from paths(item, (*at, key))


def named(path: tuple[str | int, ...]) -> str:
    """`ranks[0].hits`, as status names a field."""
    return "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path).removeprefix(".")


def checked(path: tuple[str | int, ...]) -> bool:
    """Whether `status.STATS_SHAPE` says what `path` holds (the keys status does not read are let through)."""
    shape: Any = status.STATS_SHAPE
    for key in path:
        while isinstance(shape, status.Added):
            shape = shape.shape
        if isinstance(shape, list) and isinstance(key, int):
            shape = shape[0]
        elif isinstance(shape, dict) and key in shape:
            shape = shape[key]
        else:
            return False
    return True


async def test_any_field_of_a_real_stats_of_another_type_is_one_line_never_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch's hits as text, why it is paused or the routing as a number were tracebacks: the shape left
    # out fields the display reads. Here every field of a real /stats, at every depth, is given a value of
    # each other type, or taken away: status shows the snapshot, or says in one line which field is wrong.
    async with fake_upstream() as (one, _), fake_upstream() as (other, _):
        replicas = settings(tmp_path, one).model_copy(update={"upstream": [one, other]})
        async with serve_proxy(replicas) as proxy:
            await run_rank(proxy, 0, 6, total=6)
            await run_rank(proxy, 1, 3, total=10)
            async with httpx.AsyncClient(base_url=proxy) as client:
                real = (await client.get("/stats")).json()
    # What a proxy says only while a batch runs, a rank's publications fail and the job declared its ranks,
    # given too, with a value where /stats may have null (in place of null, text or a number may be right).
    real["batches"] = [BATCH]
    real["ranks"][1] |= {key: FAILING[key] for key in FAILING if key.startswith(("publication_", "chunks_"))}
    real["ranks"][1] |= {"chunks_lost": [2], "eta_s": 30.0}
    real["ranks"][0]["finished_at"] = real["now"]
    real["job"]["ranks_declared"] = 2
    real["forgotten"]["ranks"] = 3
    assert real["routing"] == "affinity"
    assert real["totals"]["hit_ratio"] is not None
    assert real["upstreams"][0]["latency_p50_s"] is not None

    answer: list[bytes] = []
    monkeypatch.setattr(status, "fetch", lambda url, api_key, timeout_s: answer[0])

    def status_of_answer(stats: Any) -> tuple[int, str, str]:
        answer[:] = [orjson.dumps(stats)]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["status", "u", "--once"])
        if code == 0:  # and on a terminal, in each order
            for sort in status.SORTS:
                status.render(status.decode(answer[0], "u"), "u", sort=sort, height=30)
        return code, out.getvalue(), err.getvalue()

    code, out, _ = status_of_answer(real)
    assert code == 0
    assert "upstream (routing: affinity)" in out
    assert "  batch_0123 is paused: the checkpoints disk is full" in out
    refused = 0
    for path in paths(real):
        for value in [*OTHER_VALUES, MISSING]:
            stats = json.loads(json.dumps(real))
            parent = stats
            for key in path[:-1]:
                parent = parent[key]
            original = parent[path[-1]]
            if value is MISSING:
                del parent[path[-1]]
            elif kind(value) == kind(original):
                continue
            else:
                parent[path[-1]] = value
            code, out, err = status_of_answer(stats)
            case = f"{named(path)} = {'missing' if value is MISSING else json.dumps(value)}"
            if code == 0:
                assert (out[:11], err) == ("inferproxy ", ""), case
                assert value in (MISSING, None) or original is None or not checked(path), f"{case}: taken"
            else:
                refused += 1
                assert (code, out) == (1, ""), case
                assert err.startswith(f"inferproxy status: u did not answer with inferproxy's /stats: {named(path)}")
                assert err.count("\n") == 1, case
    assert refused > 500  # most of them: the fields status reads, of another type


async def test_a_server_that_trickles_its_answer_is_given_up_at_the_timeout() -> None:
    # Each byte came before the socket timed out: --once never ended.
    async with answering(trickle) as (url, _):
        code, out, err = await status_of(url, "--timeout", "1")
    assert (code, out, err) == (1, "", f"inferproxy status: {url} did not answer within 1 s (--timeout)\n")


async def test_an_answer_over_the_size_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "MAX_BODY_BYTES", 1000)
    async with answering(answer(orjson.dumps({**STATS, "ranks": [RANK] * 20}))) as (url, _):
        code, out, err = await status_of(url)
    assert (code, out) == (1, "")
    assert err == f"inferproxy status: {url} did not answer with inferproxy's /stats: a body over 1000 bytes\n"


async def test_strings_from_the_server_cannot_act_on_the_terminal() -> None:
    hostile = {
        **STATS,
        "version": "\x1b[2J\x1b[31mPWNED\x1b]0;title\x07",
        "upstreams": [{**STATS["upstreams"][0], "url": "\x1b[31mevil\x1b[0m\r\nfake line\u202e"}],
    }
    async with answering(answer(orjson.dumps(hostile))) as (url, _):
        _, table, _ = await status_of(url)
        _, as_json, _ = await status_of(url, "--json")
    for out in (table, as_json):
        assert not any(c in out for c in "\x1b\x07\r\u202e")
    assert f"inferproxy \\x1b[2J\\x1b[31mPWNED\\x1b]0;title\\x07 at {url} · up 12s" in table
    assert "\\x1b[31mevil\\x1b[0m\\r\\nfake line\\u202e  healthy" in table
    assert json.loads(as_json) == hostile


def test_finished_ranks_and_the_job_are_said_so_and_an_older_proxys_stats_as_before() -> None:
    finished = {**RANK, "done_documents": 7, "total_documents": 7, "progress": 1.0, "eta_s": 0.0, "finished": True}
    running = {**RANK, "rank": 1, "finished": False, "finished_at": None}
    job = {"ranks_declared": 2, "ranks_finished": 1, "finished": False}
    lines = status.render(status.decode(orjson.dumps({**STATS, "ranks": [finished, running], "job": job}), "u"), "u")
    assert lines[3] == "documents done 12 / 17 (70.6%) · ETA 5s · 1 of 2 ranks seen finished"
    assert lines[4] == "job running: 1 of 2 ranks finished"
    rows = rows_of(lines)
    assert "[####################] 7 / 7 · 100.0%" in rows["0"]
    assert rows["0"].split("100.0%")[1].split()[:2] == ["1.00", "finished"]
    assert rows["1"].split("50.0%")[1].split()[:2] == ["1.00", "5s"]

    done = {**finished, "rank": 1}
    job = {"ranks_declared": 2, "ranks_finished": 2, "finished": True}
    lines = status.render(status.decode(orjson.dumps({**STATS, "ranks": [finished, done], "job": job}), "u"), "u")
    assert lines[3] == "documents done 14 / 14 (100.0%) · finished · 2 of 2 ranks seen finished"
    assert lines[4] == "job finished: 2 of 2 ranks"
    # A job that did not declare its number of ranks (X-Total-Ranks): how many finished, no more.
    undeclared = {"ranks_declared": None, "ranks_finished": 1, "finished": False}
    assert (
        status.job_line(undeclared)
        == "job: 1 rank finished, of a number it did not declare (X-Total-Ranks): whether it is done is not known"
    )
    assert status.job_line({**undeclared, "ranks_finished": 0}) == ""

    # An older proxy: no `job`, no `finished` (a rank at 100% counts as finished, as before).
    older = {k: v for k, v in finished.items() if k != "finished"}
    lines = status.render(status.decode(orjson.dumps({**STATS, "ranks": [older]}), "u"), "u")
    assert lines[3] == "documents done 7 / 7 (100.0%) · finished · 1 of 1 ranks seen finished"
    assert lines[4] == ""
    assert rows_of(lines)["0"].split("100.0%")[1].split()[:2] == ["1.00", "done"]
    with pytest.raises(status.StatusError, match=r"job.finished is missing"):
        status.decode(orjson.dumps({**STATS, "job": {"ranks_declared": 2, "ranks_finished": 1}}), "u")


def test_ranks_forgotten_past_max_tracked_ranks_are_said_apart_from_the_table() -> None:
    # /stats' totals hold the forgotten ranks' counts, its `ranks` do not: the reader is told which is which.
    stats = {**STATS, "ranks": [RANK], "forgotten": {"ranks": 4, "hits": 7}}
    lines = status.render(status.decode(orjson.dumps(stats), "u"), "u")
    assert lines[3] == "documents done 5 / 10 (50.0%) · ETA 5s · 0 of 1 ranks seen finished"
    assert lines[4] == (
        "4 ranks forgotten past max_tracked_ranks: in the hit ratio, tokens and rates, not in documents done or below"
    )
    for none in ({**STATS, "forgotten": {"ranks": 0}}, STATS):  # an older proxy has no `forgotten`
        assert not any("forgotten" in line for line in status.render(status.decode(orjson.dumps(none), "u"), "u"))


def test_absurd_numbers_are_shown_in_a_few_characters() -> None:
    # Were ETAs and counts hundreds of digits long, -500.0% progress, or an OverflowError.
    huge = 1e308
    rank = {**RANK, "hits": huge, "done_documents": 1e30, "progress": 5.0, "documents_per_s": huge, "eta_s": huge}
    stats = {
        **STATS,
        "now": huge,
        "uptime_s": huge,
        "in_flight": huge,
        "totals": {"hits": huge, "coalesced": 0, "tokens_saved": huge, "hit_ratio": 3.0},
        "rates": {"requests_per_s": huge, "documents_per_s": 2.0**64},
        "upstreams": [{**STATS["upstreams"][0], "latency_p50_s": huge, "latency_p99_s": 4000.0}],
        "ranks": [rank, {**rank, "rank": 1, "progress": 0.0}],
    }
    lines = status.render(status.decode(orjson.dumps(stats), "u"), "u")
    assert max(len(line) for line in lines) < 150
    assert lines[0] == "inferproxy 0.1.0 at u · up > 999d · --:--:--"
    assert lines[2].startswith("hit ratio 100.0% · tokens saved 1e+308 · generations saved 1e+308 · 1e+308 requests/s")
    rows = {line.split()[0]: line for line in lines if line[:1].isdigit()}
    assert "[####################] 1e+30 / 10 · 100.0%  1e+308  > 999d" in rows["0"]
    assert "[....................] 1e+30 / 10 · 0.0%" in rows["1"]
    assert lines[-1].endswith("> 999d  1h 06m")
    assert [status.duration(s) for s in (-5, 86_400_000, 86_399_999)] == ["0s", "> 999d", "999d 23h"]
    assert [status.count(n) for n in (999e15, 1e18, 2.0**64)] == ["999P", "1e+18", "1.84e+19"]
    # Two ranks' 1e308 documents done of 1e308 add up to inf of inf: a ValueError, of its NaN percentage.
    both = [{**RANK, "rank": r, "done_documents": huge, "total_documents": huge} for r in (0, 1)]
    assert status._documents_done(both).startswith("documents done inf / inf (100.0%) · ")


# -- a rank's chunks and the output ---------------------------------------------------------------


@pytest.fixture
def utc() -> Iterator[None]:
    """Local time is UTC: the clock times in the lines are known."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()


NOW = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
FAILING: dict[str, Any] = {
    **RANK,
    "rank": 3,
    "chunks_published": 4,
    "chunks_waiting": 2,
    "publication_error": "publishing 00003_chunk_4.jsonl failed: [Errno 28] No space left on device",
    "publication_failing_since": NOW - 610,  # 22:03:10
    "publication_attempts": 5,
    "publication_retry_in_s": 30.0,
    "chunks_lost": [],
}
FINE: dict[str, Any] = {
    **RANK,
    "chunks_waiting": 0,
    "publication_error": None,
    "publication_failing_since": None,
    "publication_attempts": 0,
    "publication_retry_in_s": None,
    "chunks_lost": [],
}
LOST: dict[str, Any] = {**FINE, "rank": 5, "chunks_lost": [0, 2]}
SLOW: dict[str, Any] = {**FINE, "rank": 4, "chunks_waiting": 1}  # the output slow: waiting, nothing failed


def rendered(*ranks: dict[str, Any], height: int | None = None) -> list[str]:
    stats = {**STATS, "now": NOW, "ranks": list(ranks)}
    return status.render(status.decode(orjson.dumps(stats), "u"), "u", height=height)


def rows_of(lines: list[str]) -> dict[str, str]:
    return {line.split()[0]: line for line in lines if line[:1].isdigit()}


@pytest.mark.usefixtures("utc")
def test_chunks_waiting_for_the_output_and_lost_ones_are_said_per_rank_and_why() -> None:
    lines = rendered(FINE, FAILING, SLOW, LOST)
    header = next(line for line in lines if line.startswith("rank "))
    assert header.split()[:8] == ["rank", "progress", "docs/s", "ETA", "published", "here", "output", "from"]
    rows = rows_of(lines)
    assert rows["3"].split("  5s  ")[1].split()[:3] == ["4", "2", "waiting"]
    assert "1 waiting" in rows["4"]
    assert "2 LOST" in rows["5"]
    assert "waiting" not in rows["0"]
    assert "LOST" not in rows["0"]
    # Under the table: the lost chunks first (GET /resume refuses the rank), then why chunks wait.
    start = lines.index("", lines.index(header))
    assert lines[start : start + 4] == [
        "",
        "rank 5: chunks [0, 2] are missing from the output: GET /resume refuses the rank (see the proxy's log)",
        "rank 3: 2 chunks waiting for the output since 22:03 (5 attempts, next in 30s): publishing "
        "00003_chunk_4.jsonl failed: [Errno 28] No space left on device",
        "",
    ]
    assert lines[start + 4].startswith("upstream ")

    # One chunk, one attempt, failing since yesterday, retried now; thousands of chunks lost.
    once = {**FAILING, "chunks_waiting": 1, "publication_attempts": 1, "publication_retry_in_s": 0.0}
    once["publication_failing_since"] = NOW - 86_400
    many = {**LOST, "chunks_lost": list(range(5000))}
    notes = status.publication_notes([once, {**LOST, "rank": 6, "chunks_lost": [7]}, many], NOW)
    assert notes == [
        "rank 5: chunks [0, 1, 2, 3, 4, 5, 6, 7, … 4992 more] are missing from the output: GET /resume refuses "
        "the rank (see the proxy's log)",
        "rank 6: chunk 7 is missing from the output: GET /resume refuses the rank (see the proxy's log)",
        "rank 3: 1 chunk waiting for the output since 2023-11-13 22:13 (1 attempt, next in 0s): publishing "
        "00003_chunk_4.jsonl failed: [Errno 28] No space left on device",
    ]
    assert "5k LOST" in rows_of(rendered(many))["5"]

    # All published, or a proxy from before these fields: the table as it was, nothing under it.
    for ranks in ([FINE], [RANK]):
        lines = rendered(*ranks)
        assert "output" not in next(line for line in lines if line.startswith("rank "))
        assert not any("waiting" in line or "missing" in line for line in lines)
        assert lines[lines.index("", 6) + 1].startswith("upstream ")


def test_a_publication_error_cannot_act_on_the_terminal() -> None:
    hostile = {**FAILING, "publication_error": "\x1b[2J\x1b]0;title\x07\r\ndisk full\u202e"}
    lines = rendered(hostile)
    assert not any(c in line for line in lines for c in "\x1b\x07\r\n\u202e")
    assert any(line.endswith("): \\x1b[2J\\x1b]0;title\\x07\\r\\ndisk full\\u202e") for line in lines)


def test_on_a_small_terminal_the_ranks_whose_chunks_wait_stay_in_view_with_the_table() -> None:
    # The output away: every rank's publications fail, each says why in a line of its own.
    ranks = [{**FAILING, "rank": r} for r in range(300)] + [{**LOST, "rank": 300}]
    lines = rendered(*ranks, height=30)
    assert len(lines) == 30
    assert lines[-1].startswith("http://127.0.0.1:8000")  # the replicas stay in view
    notes = [line for line in lines if line.startswith("rank ") and ": " in line]
    assert notes[0].startswith("rank 300: chunks [0, 2] are missing from the output")  # the loudest first
    assert notes[1].startswith("rank 0: 2 chunks waiting for the output since ")
    assert f"… {301 - len(notes)} more ranks whose chunks wait or are lost (--once: all)" in lines
    table = [line for line in lines if line[:1].isdigit()]
    assert len(table) >= 5
    assert f"… {301 - len(table)} more ranks (--sort progress: least done first; --once: all)" in lines
    # --once: every line.
    assert len([line for line in rendered(*ranks) if line.startswith("rank ") and ": " in line]) == 301


async def status_until(proxy: str, shown: Callable[[str], bool]) -> str:
    """`inferproxy status PROXY --once`'s output once `shown` is true of it (publications run in the background)."""
    deadline = time.monotonic() + 30
    while True:
        code, out, err = await inferproxy_status(proxy, "--once")
        assert (code, err) == (0, "")
        if shown(out):
            return out
        assert time.monotonic() < deadline, out
        await asyncio.sleep(0.2)


async def test_once_says_why_a_ranks_chunks_wait_and_which_are_lost_from_the_output(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("a file where the output folder should be")  # every publication fails
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url, publish_retry_max_s=1)) as proxy:
        await write_chunks(proxy, 3, range(1))
        lines = (await status_until(proxy, lambda out: "waiting for the output since" in out)).splitlines()
        assert "1 waiting" in rows_of(lines)["3"]
        [note] = [line for line in lines if line.startswith("rank 3: ")]
        assert note.startswith("rank 3: 1 chunk waiting for the output since ")
        assert " attempt" in note
        assert ": publishing 00003_chunk_0.jsonl failed: [Errno 20] Not a directory: " in note

        # The output back: the chunk is published at the next try, and the lines go.
        (tmp_path / "out").unlink()
        out = await status_until(proxy, lambda out: "waiting" not in out)
        assert "output" not in next(line for line in out.splitlines() if line.startswith("rank "))
        assert os.listdir(tmp_path / "out") == ["00003_chunk_0.jsonl"]
        await publish_chunks(proxy, 3, range(1, 3))

    # The output loses chunks 0 and 2 while nobody runs; the next proxy finds out when the rank comes back.
    async with proxy_finding_chunks_lost(tmp_path, 3, (0, 2)) as proxy:
        code, out, _ = await inferproxy_status(proxy, "--once")
        assert code == 0
        assert "2 LOST" in rows_of(out.splitlines())["3"]
        assert (
            "rank 3: chunks [0, 2] are missing from the output: GET /resume refuses the rank (see the proxy's log)"
            in out.splitlines()
        )


def test_the_batches_the_proxy_runs_are_a_table_of_their_own_and_an_older_proxy_has_none() -> None:
    batch = {
        "id": "batch_0123",
        "status": "in_progress",
        "total": 2000,
        "completed": 480,
        "failed": 20,
        "in_flight": 16,
        "usage": {"input_tokens": 10, "output_tokens": 20, "total_tokens": 30},
        "hits": 0,
        "lines_per_s": 12.5,
        "eta_s": 120.0,
    }
    lines = status.render(status.decode(orjson.dumps({**STATS, "batches": [batch]}), "u"), "u")
    header = next(line for line in lines if line.lstrip().startswith("batch "))
    assert header.split() == ["batch", "status", "done", "failed", "in", "flight", "from", "cache", "lines/s", "ETA"]
    row = next(line for line in lines if "batch_0123" in line)
    assert row.split() == [
        "batch_0123",
        "in_progress",
        "500",
        "/",
        "2k",
        "(25.0%)",
        "20",
        "16",
        "0",
        "12.5",
        "2m",
        "00s",
    ]
    assert not any("no job has talked" in line for line in lines)  # the proxy is busy: with a batch
    why = "the checkpoints disk is full (No space left on device): free space under /ckpt"
    lines = status.render(status.decode(orjson.dumps({**STATS, "batches": [{**batch, "paused": why}]}), "u"), "u")
    assert next(line for line in lines if "batch_0123" in line).split()[1:3] == ["in_progress", "PAUSED"]
    assert f"  batch_0123 is paused: {why}" in lines
    assert not any("lines/s" in line for line in status.render(status.decode(orjson.dumps(STATS), "u"), "u"))
    with pytest.raises(status.StatusError, match=r"batches\[0\].total"):
        status.decode(orjson.dumps({**STATS, "batches": [{**batch, "total": -1}]}), "u")


def test_the_batches_that_ended_are_a_line_instead_of_no_job_and_an_older_proxy_still_says_no_job() -> None:
    def shown(**extra: Any) -> list[str]:
        return status.render(status.decode(orjson.dumps({**STATS, **extra}), "u"), "u")

    done = {"completed": 3, "failed": 0, "cancelled": 1, "expired": 0}
    lines = shown(batches=[], batches_done=done)
    assert "batches: 3 completed, 1 cancelled (GET /v1/batches)" in lines
    assert not any("no job" in line for line in lines)
    for older in ({}, {"batches": []}, {"batches": [], "batches_done": {}}):  # before the Batch API; batches off
        lines = shown(**older)
        assert "no job yet" in lines
        assert "no job has talked to this proxy since it started" in lines
        assert not any(line.startswith("batches:") for line in lines)
    with pytest.raises(status.StatusError, match=r"batches_done.failed is \"1\", not a number >= 0"):
        status.decode(orjson.dumps({**STATS, "batches_done": {**done, "failed": "1"}}), "u")

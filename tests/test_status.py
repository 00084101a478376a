"""`inferproxy status`: a real proxy's numbers in the terminal, once or refreshing under a pty."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app import status
from tests.e2e.conftest import running_upstream, start_proxy
from tests.jobs import run_rank, settings
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
        assert "documents done 23 on 3 ranks (totals declared by 2)" in out
        rows = {line.split()[0]: line for line in lines if line[:1].isdigit()}
        assert set(rows) == {"0", "1", "2"}
        assert "[####################] 12 / 12 · 100.0%" in rows["0"]
        assert "[########............] 8 / 20 · 40.0%" in rows["1"]
        assert "3 done (no total declared)" in rows["2"]
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
    assert [line.split()[0] for line in lines if line[:1].isdigit()] == [str(r) for r in range(20)]
    assert "… 280 more ranks (--sort progress: least done first; --once: all)" in lines
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


async def test_an_unreachable_proxy_is_one_line_and_exit_code_1() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    code, out, err = await inferproxy_status(dead, "--once")
    assert (code, out) == (1, "")
    assert err.startswith(f"inferproxy status: cannot reach {dead}: ")
    assert len(err.splitlines()) == 1


def read_until(master: int, wanted: bytes, output: bytearray, times: int = 1) -> None:
    """Read the pty until `wanted` has appeared `times` times in all that was read, or the terminal is closed."""
    deadline = time.monotonic() + 30
    while output.count(wanted) < times:
        assert time.monotonic() < deadline, f"never saw {wanted!r} {times} times in {bytes(output)[-2000:]!r}"
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
                assert watcher.wait(timeout=30) == 0
                read_until(master, b"never printed", output)  # the rest, up to the closed terminal
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

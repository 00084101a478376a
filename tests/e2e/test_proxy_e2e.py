"""inferproxy serve + inferproxy fake-upstream as real processes, driven by the official openai client."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Proxy, Upstream, start_proxy
from tests.servers import free_port, process, wait_for_http

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "user", "content": "Say something about caches."}]


_clients: list[openai.OpenAI] = []


def client(proxy: Proxy, **kwargs: object) -> openai.OpenAI:
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]
    _clients.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def chat(c: openai.OpenAI, doc_id: str = "doc-1", rollout: int = 0, **kwargs: object) -> tuple[str, str]:
    options: dict[str, object] = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 8, **kwargs}
    raw = c.chat.completions.with_raw_response.create(
        extra_headers={"X-Doc-Id": doc_id, "X-Rollout-Idx": str(rollout)},
        **options,  # type: ignore[arg-type]
    )
    completion = raw.parse()
    return raw.headers["x-cache"], completion.choices[0].message.content or ""


def test_openai_client_chat_and_completions_are_cached(proxy: Proxy, upstream: Upstream) -> None:
    c = client(proxy, default_headers={"X-Rank": "2"})
    first = chat(c)
    second = chat(c)
    assert (first[0], second[0]) == ("MISS", "HIT")
    assert second[1] == first[1]
    assert chat(c, rollout=1)[0] == "MISS"

    raw = c.completions.with_raw_response.create(
        model="fake-model", prompt="Once", max_tokens=5, extra_headers={"X-Doc-Id": "doc-2"}
    )
    again = c.completions.with_raw_response.create(
        model="fake-model", prompt="Once", max_tokens=5, extra_headers={"X-Doc-Id": "doc-2"}
    )
    assert (raw.headers["x-cache"], again.headers["x-cache"]) == ("MISS", "HIT")
    assert again.parse().choices[0].text == raw.parse().choices[0].text
    assert upstream.stats()["generations"] == 3


def test_openai_client_streams_and_the_stream_is_replayed(proxy: Proxy) -> None:
    c = client(proxy)

    def streamed() -> tuple[str, str, int | None]:
        with c.chat.completions.with_streaming_response.create(
            model="fake-model",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Doc-Id": "s-1"},
        ) as response:
            state = response.headers["x-cache"]
            text, usage = "", None
            for chunk in response.parse():
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return state, text, usage

    first, second = streamed(), streamed()
    assert (first[0], second[0]) == ("MISS", "HIT")
    assert second[1:] == first[1:]
    assert len(first[1].split()) == 6
    assert first[2] == 6


def test_stream_chunks_reach_the_client_as_they_arrive(proxy: Proxy) -> None:
    body = {
        "model": "fake-model",
        "prompt": "x",
        "max_tokens": 6,
        "stream": True,
        "fake_upstream": {"chunk_delay_ms": 300},
    }
    start = time.monotonic()
    arrivals = []
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, headers={"X-Doc-Id": "slow"}, timeout=30) as r:
        for _ in r.iter_bytes():
            arrivals.append(time.monotonic() - start)
    # 7 events 300 ms apart: a buffering proxy would deliver everything at once, at the end
    assert arrivals[0] < arrivals[-1] - 1.0


def test_a_400_is_replayed_without_a_second_upstream_call(proxy: Proxy, upstream: Upstream) -> None:
    c = client(proxy)
    for _ in range(2):
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            chat(c, max_tokens=100_000)
    assert upstream.stats()["by_path"]["POST /v1/chat/completions"] == 1


def test_a_500_is_not_cached(proxy: Proxy, upstream: Upstream) -> None:
    c = client(proxy)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            chat(c, extra_body={"fake_upstream": {"status": 500}})
    assert upstream.stats()["by_path"]["POST /v1/chat/completions"] == 2


def test_eight_concurrent_identical_requests_cost_one_generation(upstream: Upstream, tmp_path: Path) -> None:
    port = free_port()
    with process("fake-upstream", f"--port={port}", "--latency-ms=2000") as _:
        slow_url = f"http://127.0.0.1:{port}"
        wait_for_http(slow_url + "/v1/models")
        args, proxy_port = start_proxy(slow_url, tmp_path)
        with process(*args):
            proxy = Proxy(f"http://127.0.0.1:{proxy_port}", args, None)  # type: ignore[arg-type]
            wait_for_http(proxy.url + "/healthz")
            c = client(proxy)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda _: chat(c), range(8)))
            # One generation; the others joined it (COALESCED), or, sent once it was stored on a machine busy
            # with parallel tests, were answered from the cache (HIT): none paid again
            states = sorted(state for state, _ in results)
            assert states.count("MISS") == 1, states
            assert "COALESCED" in states, states
            assert set(states) <= {"MISS", "COALESCED", "HIT"}, states
            assert len({text for _, text in results}) == 1
            assert httpx.get(slow_url + "/_fake/stats").json()["generations"] == 1


def until(done: Any, what: str, timeout: float = 30) -> None:
    """Until `done()` is true (what it waits for named in the failure)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def committed(checkpoints: Path, rank: int = 0) -> int:
    """The answers committed in the rank's cache file (what a kill -9 cannot take back)."""
    database = checkpoints / f"{rank:05d}" / "replay.sqlite3"
    if not database.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as conn:
        count: int = conn.execute("SELECT count(*) FROM request_cache").fetchone()[0]
        return count


def test_sigkill_and_restart_still_serves_hits(proxy: Proxy, upstream: Upstream, tmp_path: Path) -> None:
    c = client(proxy)
    _, text = chat(c)
    until(lambda: committed(tmp_path / "checkpoints") == 1, "the answer committed")  # its group commit: 50 ms
    proxy.proc.send_signal(signal.SIGKILL)
    proxy.proc.wait(timeout=10)
    with process(*proxy.args):
        wait_for_http(proxy.url + "/healthz")
        assert chat(c) == ("HIT", text)
    assert upstream.stats()["generations"] == 1


@pytest.mark.parametrize("http", ["builtin", "uvicorn"])
def test_sigterm_finishes_in_flight_requests_flushes_and_exits_0(upstream: Upstream, tmp_path: Path, http: str) -> None:
    args, port = start_proxy(upstream.url, tmp_path, f"--http={http}")
    with process(*args) as proc:
        proxy = Proxy(f"http://127.0.0.1:{port}", args, proc)
        wait_for_http(proxy.url + "/healthz")
        c = client(proxy)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            before = upstream.stats()["requests"]
            slow = pool.submit(chat, c, "slow-doc", extra_body={"fake_upstream": {"latency_ms": 1000}})
            until(lambda: upstream.stats()["requests"] > before, "the slow request in flight upstream")
            _, quick = chat(c, "quick-doc")
            proxy.proc.send_signal(signal.SIGTERM)  # at once: well inside the flush window
            state, slow_text = slow.result(timeout=30)
        assert state == "MISS"
        assert proxy.proc.wait(timeout=30) == 0
    with process(*args):
        wait_for_http(proxy.url + "/healthz")
        assert chat(c, "quick-doc") == ("HIT", quick)
        assert chat(c, "slow-doc", extra_body={"fake_upstream": {"latency_ms": 1000}}) == ("HIT", slow_text)
    assert upstream.stats()["generations"] == 2


@contextlib.contextmanager
def stuck_request(
    upstream: Upstream, tmp_path: Path, *flags: str
) -> Iterator[tuple[subprocess.Popen[bytes], concurrent.futures.Future[Any]]]:
    """A proxy (its stderr read by the test) with one request in flight at the upstream that never answers."""
    args, port = start_proxy(upstream.url, tmp_path, *flags, "--log-level=info")
    with process(*args, read_stderr=True) as proc, concurrent.futures.ThreadPoolExecutor(1) as pool:
        proxy = Proxy(f"http://127.0.0.1:{port}", args, proc)
        wait_for_http(proxy.url + "/healthz")
        stuck = pool.submit(chat, client(proxy), "stuck-doc", extra_body={"fake_upstream": {"latency_ms": 600_000}})
        while not upstream.stats()["by_path"].get("POST /v1/chat/completions"):  # until it is in flight upstream
            time.sleep(0.02)
        yield proc, stuck


def logged_until(proc: subprocess.Popen[bytes], log: list[str], text: str) -> None:
    """Read the proxy's stderr into `log` up to a line holding `text`."""
    assert proc.stderr is not None
    while not log or text not in log[-1]:
        log.append(proc.stderr.readline().decode())
        assert log[-1], "".join(log)


def test_two_sigterms_at_once_are_one_stop_and_a_later_one_cuts_the_requests_in_flight(
    upstream: Upstream, tmp_path: Path
) -> None:
    """`timeout` and Slurm's scancel signal the process and then its group: the two SIGTERMs of one stop
    must not cut the requests in flight (it read as an impatient operator's second signal)."""
    with stuck_request(upstream, tmp_path) as (proc, stuck):
        proc.send_signal(signal.SIGTERM)
        log: list[str] = []
        logged_until(proc, log, "finishing requests in flight")
        proc.send_signal(signal.SIGTERM)  # the group's, just after (two at once would be delivered as one)
        logged_until(proc, log, "the same stop")
        assert proc.poll() is None  # still finishing the request in flight
        assert not stuck.done()
        time.sleep(1.1)  # past the window: a SIGTERM now is a second stop (a wait, not a barrier)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        log.append(proc.stderr.read().decode())
        assert code == 0, "".join(log)
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
            stuck.result(timeout=30)
    assert "SIGTERM again: not waiting for requests in flight" in log[-1]
    assert "Traceback" not in "".join(log)


@pytest.mark.parametrize("http", ["builtin", "uvicorn"])
def test_a_second_sigint_cuts_the_requests_in_flight_and_exits_without_a_traceback(
    upstream: Upstream, tmp_path: Path, http: str
) -> None:
    with stuck_request(upstream, tmp_path, f"--http={http}") as (proc, stuck):
        proc.send_signal(signal.SIGINT)
        log: list[str] = []
        logged_until(proc, log, "finishing requests in flight")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        log.append(proc.stderr.read().decode())
        assert code == 0, "".join(log)
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
            stuck.result(timeout=30)
    assert "SIGINT again" in log[-1]
    assert log[-1].rstrip().endswith("stopped: every cache flushed, every rank released")  # a last word
    assert "Traceback" not in "".join(log)
    assert "Error" not in "".join(log)


def test_upstream_down_gives_502_within_bounded_time(tmp_path: Path) -> None:
    args, port = start_proxy(f"http://127.0.0.1:{free_port()}", tmp_path)
    with process(*args):
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url + "/healthz")
        assert httpx.get(url + "/readyz").status_code == 503
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            chat(client(Proxy(url, args, None)))  # type: ignore[arg-type]
        assert caught.value.status_code == 502
        assert time.monotonic() - start < 15


def test_a_second_proxy_shares_the_checkpoints_and_takes_a_rank_over_when_its_owner_is_killed(
    proxy: Proxy, upstream: Upstream, tmp_path: Path
) -> None:
    first = chat(client(proxy), doc_id="kept")
    args, port = start_proxy(upstream.url, tmp_path)  # the same checkpoints dir, another port
    with process(*args):
        other = Proxy(f"http://127.0.0.1:{port}", args, proxy.proc)
        wait_for_http(other.url + "/healthz")
        with pytest.raises(openai.APIStatusError) as refused:
            chat(client(other), doc_id="kept")
        assert refused.value.status_code == 409
        assert f"rank 0 is owned by another inferproxy (pid {proxy.proc.pid} on host" in refused.value.message
        assert chat(client(other, default_headers={"X-Rank": "1"}), doc_id="elsewhere")[0] == "MISS"
        proxy.proc.kill()  # the owner dies: its lock goes with it
        proxy.proc.wait(timeout=10)
        taken_over = chat(client(other), doc_id="kept")
        assert taken_over == ("HIT", first[1])  # what the dead proxy stored, replayed by the new owner
    assert upstream.stats()["generations"] == 2

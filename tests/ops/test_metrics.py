"""`/metrics`, `/stats` and the request log, against a real proxy and the fake upstream on loopback ports."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.checkpoints.documents import DocumentLike
from app.job.run import run_job
from app.ops.metrics import HISTORY_EVERY_S, HISTORY_POINTS, SAMPLE_EVERY_S, Metrics
from app.service.settings import Settings
from app.tools.fake_upstream import FakeUpstream
from tests.factories import chat_request, doc_headers
from tests.jobs import settings
from tests.servers import fake_upstream, serve_in_loop, serve_proxy

pytestmark = pytest.mark.usefixtures("http_server")

DOCS = [{"id": f"doc-{i}", "text": f"question {i}"} for i in range(10)]


class Env:
    def __init__(self, proxy: str, upstream: FakeUpstream, client: httpx.AsyncClient) -> None:
        self.proxy = proxy
        self.upstream = upstream
        self.client = client

    async def rollout(self, document: DocumentLike, rollout_idx: int, headers: dict[str, str]) -> str:
        async with openai.AsyncOpenAI(base_url=self.proxy + "/v1", api_key="unused", max_retries=0) as client:
            answer = await client.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": document.text}],
                max_tokens=4,
                extra_headers=headers,
            )
        return answer.choices[0].message.content or ""

    async def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of `/metrics`, parsed by prometheus-client's own parser."""
        answer = await self.client.get("/metrics")
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/plain; version=")
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(answer.text)
            for sample in family.samples
        }

    async def stats(self) -> dict[str, Any]:
        answer = await self.client.get("/stats")
        assert answer.status_code == 200
        result: dict[str, Any] = answer.json()
        return result


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with (
        fake_upstream() as (url, upstream),
        serve_proxy(settings(tmp_path, url, retry_backoff_s=0.001)) as proxy,
        httpx.AsyncClient(base_url=proxy, timeout=30) as client,
    ):
        yield Env(proxy, upstream, client)


def rank(labels: dict[str, str] | None = None, **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"rank": "0", **(labels or {}), **more}.items()))


async def test_metrics_parse_and_move_as_a_job_runs(env: Env) -> None:
    before = await env.scrape()
    assert before[("inferproxy_start_time_seconds", ())] > 0
    report = await run_job(DOCS, env.rollout, base_url=env.proxy, rollouts_per_document=2, concurrency=4)
    assert report.written == 10
    after = await env.scrape()
    miss = (("cache", "MISS"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert after[("inferproxy_requests_total", miss)] == 20
    assert after[("inferproxy_cache_misses_total", rank())] == 20
    assert after[("inferproxy_documents_written_total", rank())] == 10
    assert after[("inferproxy_chunks_published_total", rank())] == 3  # 4 + 4 + the last 2
    assert after[("inferproxy_last_chunk_index", rank())] == 2
    assert after[("inferproxy_documents_done", rank())] == 10
    upstream = {name: value for (name, labels), value in after.items() if name.startswith("inferproxy_upstream_")}
    assert any(name == "inferproxy_upstream_requests_total" and value >= 20 for name, value in upstream.items())
    assert any(name == "inferproxy_upstream_latency_seconds_count" and value >= 20 for name, value in upstream.items())
    assert after[("inferproxy_fsync_seconds_count", ())] > before.get(("inferproxy_fsync_seconds_count", ()), 0)

    # The same request again is a hit: the GPU work it saved is its answer's usage.total_tokens.
    first = await env.client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers("again"))
    for _ in range(3):
        hit = await env.client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers("again"))
        assert hit.headers["x-cache"] == "HIT"
    tokens = first.json()["usage"]["total_tokens"]
    scraped = await env.scrape()
    assert scraped[("inferproxy_cache_hits_total", rank())] == 3
    assert scraped[("inferproxy_generations_saved_total", rank())] == 3
    assert scraped[("inferproxy_tokens_saved_total", rank())] == 3 * tokens
    hits = (("cache", "HIT"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert scraped[("inferproxy_requests_total", hits)] == 3


async def test_stats_and_metrics_show_the_same_numbers(env: Env) -> None:
    await run_job(DOCS[:6], env.rollout, base_url=env.proxy, concurrency=2)
    streamed = chat_request(stream=True, stream_options={"include_usage": True})
    for _ in range(2):
        await env.client.post("/v1/chat/completions", json=streamed, headers={**doc_headers("s"), "X-Rank": "3"})
    scraped = await env.scrape()
    stats = await env.stats()
    by_rank = {r["rank"]: r for r in stats["ranks"]}
    for number, view in by_rank.items():
        label = rank(rank=str(number))
        assert scraped[("inferproxy_cache_hits_total", label)] == view["hits"]
        assert scraped[("inferproxy_cache_misses_total", label)] == view["misses"]
        assert scraped[("inferproxy_tokens_saved_total", label)] == view["tokens_saved"]
        assert scraped[("inferproxy_documents_written_total", label)] == view["documents"]
    assert by_rank[3]["hits"] == 1
    assert by_rank[3]["tokens_saved"] > 0  # the stream's usage chunk
    assert by_rank[0]["documents"] == 6
    assert by_rank[0]["last_chunk_index"] == 1
    assert by_rank[3]["cache_bytes"] > 0
    assert stats["totals"]["hits"] == 1
    assert stats["totals"]["misses"] == 7
    assert stats["totals"]["hit_ratio"] == pytest.approx(1 / 8, abs=1e-3)
    assert stats["requests"]["hit"] == 1
    assert stats["rates"]["window_s"] >= 0
    assert stats["history"]  # sampled at start
    assert stats["owned_ranks"] == [3]  # rank 0 finished: released
    assert stats["upstreams"][0]["requests"] == 7
    # Entries are counted in the file (committed within flush_interval_ms), again at most once a second.
    deadline = time.monotonic() + 30
    while next(r for r in (await env.stats())["ranks"] if r["rank"] == 3)["cache_entries"] != 1:
        assert time.monotonic() < deadline, "the stored answer was never counted"
        await asyncio.sleep(0.2)


async def test_a_declared_total_gives_progress_and_an_eta(env: Env) -> None:
    headers = {"X-Rank": "2", "X-Total-Documents": "40"}
    assert (await env.client.get("/resume", headers=headers)).status_code == 200
    view = next(r for r in (await env.stats())["ranks"] if r["rank"] == 2)
    assert view["total_documents"] == 40
    assert view["progress"] == 0.0
    docs = [{"id": f"d{i}", "text": "t"} for i in range(4)]
    written = await env.client.post("/documents", json=docs, headers={"X-Rank": "2", "X-Chunk-Index": "0"})
    assert written.status_code == 200
    await env.client.get("/resume", headers=headers)  # answered once the complete chunk is published
    view = next(r for r in (await env.stats())["ranks"] if r["rank"] == 2)
    assert view["done_documents"] == 4
    assert view["progress"] == 0.1
    assert view["documents_per_s"] > 0
    assert view["eta_s"] is not None
    assert view["eta_s"] > 0
    assert view["chunks_published"] == 1


@pytest.mark.parametrize("value", ["-1", "ten", "1e3", ""])
async def test_a_bad_declared_total_is_refused_and_nothing_is_written(env: Env, value: str) -> None:
    answer = await env.client.post(
        "/documents", json={"id": "a", "text": "t"}, headers={"X-Chunk-Index": "0", "X-Total-Documents": value}
    )
    assert answer.status_code == 400
    assert "X-Total-Documents" in answer.json()["error"]["message"]
    assert (await env.client.get("/resume")).json()["processed_ids"] == []


async def test_upstream_retries_and_errors_are_counted_per_replica(env: Env) -> None:
    flaky = chat_request(fake_upstream={"status": 503, "fail_times": 1})
    answer = await env.client.post("/v1/chat/completions", json=flaky, headers=doc_headers("flaky"))
    assert answer.status_code == 200
    replica = (await env.stats())["upstreams"][0]
    assert replica["retries"] == 1
    assert replica["errors"] == 1
    assert replica["requests"] == 2
    assert replica["latency_p50_s"] is not None


async def test_with_metrics_off_hits_are_not_counted(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _):
        settings = Settings(upstream=[url], checkpoints_dir=tmp_path / "ckpt", metrics=False)
        async with serve_proxy(settings) as proxy, httpx.AsyncClient(base_url=proxy) as client:
            for _ in range(3):
                await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
            stats = (await client.get("/stats")).json()
    assert stats["totals"]["hits"] == 0
    assert stats["totals"]["misses"] == 1


async def test_one_log_line_per_request_and_one_per_n_hits_never_a_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inferproxy.access")
    async with fake_upstream() as (url, _):
        settings = Settings(upstream=[url], checkpoints_dir=tmp_path / "ckpt", log_hits_every=2, api_key="sekrit")
        async with serve_proxy(settings) as proxy, httpx.AsyncClient(base_url=proxy) as client:
            auth = {"Authorization": "Bearer sekrit"}
            body = chat_request(messages=[{"role": "user", "content": "private prompt"}])
            for _ in range(5):  # a miss, then 4 hits: 2 of them logged
                await client.post("/v1/chat/completions", json=body, headers={**auth, **doc_headers("d 1")})
            await client.get("/v1/models", headers=auth)
            await client.get("/stats")  # 401: no key
    lines = [r for r in caplog.records if r.name == "inferproxy.access"]
    outcomes = [getattr(r, "request")["cache"] for r in lines]  # noqa: B009
    assert outcomes == ["MISS", "HIT", "HIT", None, None]
    miss = getattr(lines[0], "request")  # noqa: B009
    assert miss["method"] == "POST"
    assert miss["path"] == "/v1/chat/completions"
    assert miss["status"] == 200
    assert miss["rank"] is None  # no X-Rank sent
    assert miss["doc_id"] == "d 1"
    assert miss["replica"] == url
    assert miss["duration_ms"] > 0
    assert lines[0].getMessage().startswith('POST /v1/chat/completions 200 MISS rank=- doc="d 1" replica=')
    assert [getattr(r, "request")["status"] for r in lines[3:]] == [200, 401]  # noqa: B009
    assert "sekrit" not in caplog.text
    assert "private prompt" not in caplog.text


@pytest.mark.parametrize("http_server", ["builtin"], indirect=True)  # uvicorn logs any cut as its error
async def test_an_upstream_cut_mid_stream_is_a_warning_not_an_error(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    cut = chat_request(stream=True, fake_upstream={"disconnect_after_chunks": 2})
    with pytest.raises(httpx.HTTPError):
        await read_stream(env.client, cut)
    # The fake upstream (served in this process) logs its injected cut as an error; the proxy must not.
    proxy_errors = [r for r in caplog.records if r.levelno >= logging.ERROR and not injected(r)]
    assert proxy_errors == []
    assert any("broke off" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def injected(record: logging.LogRecord) -> bool:
    """A log record of the fake upstream's own injected fault."""
    return record.exc_info is not None and "injected" in str(record.exc_info[1])


async def test_a_client_leaving_mid_stream_is_no_error(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    slow = chat_request(stream=True, max_tokens=50, fake_upstream={"chunk_delay_ms": 20})
    async with (
        httpx.AsyncClient(base_url=env.proxy) as client,
        client.stream("POST", "/v1/chat/completions", json=slow, headers=doc_headers()) as answer,
    ):
        async for _ in answer.aiter_bytes():
            break  # and leave
    deadline = time.monotonic() + 30
    while not any(r.name == "inferproxy.access" for r in caplog.records):
        assert time.monotonic() < deadline, "the request was never logged"
        await asyncio.sleep(0.05)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR and not r.name.startswith("uvicorn")] == []
    line = next(getattr(r, "request") for r in caplog.records if r.name == "inferproxy.access")  # noqa: B009
    assert line["status"] == 200
    assert line["cache"] == "MISS"


async def read_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=doc_headers()) as answer:
        async for _ in answer.aiter_bytes():
            pass


def test_the_history_of_a_proxy_that_has_seen_thousands_of_ranks_keeps_totals_only() -> None:
    """A proxy lives through thousands of ranks (a job's tasks); an hour of history is HISTORY_POINTS samples,
    and each held every rank's count (bench/soak.py: tens of MiB after an hour of a new rank a second)."""
    metrics = Metrics()
    for rank in range(5000):
        metrics.rank(rank).done_documents = rank
    for point in range(HISTORY_POINTS):
        metrics.sample(now=point * HISTORY_EVERY_S)
    assert len(metrics.history) == HISTORY_POINTS
    assert all(point.done == {} for point in metrics.history)
    assert metrics.history[-1].totals == metrics.totals()


def test_a_proxy_that_sees_a_new_rank_after_another_holds_a_bounded_number_and_exact_totals() -> None:
    """A job of thousands of short tasks brings a new rank each (bench/soak.py's `task`): past
    `max_tracked_ranks` the least recently active ranks not open are forgotten, their counts kept in
    `forgotten`, so that memory stays bounded and the totals stay whole and never go back."""
    metrics = Metrics(max_tracked_ranks=100)
    owned = {0}  # open all along, idle the longest: kept
    metrics.rank(0).misses = 1
    expected = {"hits": 0, "misses": 1, "documents": 0}
    previous = metrics.totals()
    tracemalloc.start()
    try:
        for new in range(2, 20_001):
            counters = metrics.rank(new)
            counters.misses, counters.hits, counters.documents = 1, new % 3, 1
            expected["hits"] += new % 3
            expected["misses"] += 1
            expected["documents"] += 1
            metrics.rank(1).hits += 1  # a rank used all along: never the least recently active
            expected["hits"] += 1
            if new % 10 == 0:  # a sampling interval: ten new ranks
                metrics.sample(now=new / 10 * SAMPLE_EVERY_S)
                metrics.forget_idle_ranks(keep=owned)
                assert len(metrics.ranks) <= 100
                totals = metrics.totals()
                assert {name: totals[name] for name in expected} == expected
                assert all(totals[name] >= previous[name] for name in totals)
                previous = totals
            if new == 2_000:
                held_at_2k = tracemalloc.get_traced_memory()[0]
        held_at_20k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert {0, 1, 20_000} <= metrics.ranks.keys()
    assert metrics.ranks_forgotten == 20_001 - 100
    assert metrics.forgotten.misses == metrics.ranks_forgotten  # one miss each (rank 1 has none, and is kept)
    # 18,000 more ranks seen: ~14 MB if each were kept (~0.8 KB), a few KB of noise here.
    assert held_at_20k - held_at_2k < 100_000


def test_a_reading_of_the_ranks_keeps_its_moment_while_the_event_loop_counts_on() -> None:
    """`/stats` adds up a reading in a thread, then shows each of its ranks: a hit counted in between must
    show in neither, or a rank's count is past what the totals say (the contract: each total is the sum of
    `ranks` and `forgotten`)."""
    metrics = Metrics(max_tracked_ranks=1)
    metrics.rank(0).hits, metrics.rank(1).hits = 2, 3
    tracked = metrics.tracked()
    totals = metrics.totals(tracked)
    metrics.rank(1).hits += 1  # the event loop, while the thread builds the answer
    metrics.forget_idle_ranks(keep=set())
    ranks, forgotten = tracked
    assert totals["hits"] == sum(c.hits for c in ranks.values()) + forgotten.hits == 5
    assert metrics.totals()["hits"] == 6


async def test_forgotten_ranks_are_shown_apart_and_every_total_still_adds_up(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream):
        # each rank released at once, so that it may be forgotten
        configured = settings(tmp_path, url, rank_idle_s=0.1, max_tracked_ranks=2)
        async with serve_proxy(configured) as proxy, httpx.AsyncClient(base_url=proxy, timeout=30) as client:
            env = Env(proxy, upstream, client)
            for number in range(5):
                headers = {**doc_headers(f"d{number}"), "X-Rank": str(number)}
                for _ in range(number + 1):  # a miss, then hits
                    answer = await client.post("/v1/chat/completions", json=chat_request(), headers=headers)
                    assert answer.status_code == 200
            deadline = time.monotonic() + 60
            while (stats := await env.stats())["forgotten"]["ranks"] != 3:
                assert time.monotonic() < deadline, f"3 ranks were never forgotten: {stats['forgotten']}"
                await asyncio.sleep(0.2)
            scraped = await env.scrape()
    forgotten, totals = stats["forgotten"], stats["totals"]
    assert [r["rank"] for r in stats["ranks"]] == [3, 4]  # the most recently active
    assert forgotten == {
        "ranks": 3,
        "hits": 0 + 1 + 2,
        "coalesced": 0,
        "misses": 3,
        "refreshed": 0,
        "tokens_saved": forgotten["tokens_saved"],
        "documents": 0,
        "duplicates": 0,
        "chunks_published": 0,
    }
    for name in ("hits", "misses", "tokens_saved"):
        assert totals[name] == forgotten[name] + sum(r[name] for r in stats["ranks"])
    assert totals["hits"] == 0 + 1 + 2 + 3 + 4
    assert scraped[("inferproxy_ranks_forgotten_total", ())] == 3
    assert scraped[("inferproxy_cache_hits_total", rank(rank="forgotten"))] == 3
    hits = {labels: value for (name, labels), value in scraped.items() if name == "inferproxy_cache_hits_total"}
    assert sum(hits.values()) == totals["hits"]


def test_the_json_log_format_is_one_object_per_line(tmp_path: Path) -> None:
    from app.ops.logs import JSONFormatter

    record = logging.LogRecord("inferproxy.access", logging.INFO, __file__, 1, "GET / %d", (200,), None)
    record.request = {"method": "GET", "status": 200}
    line = json.loads(JSONFormatter().format(record))
    assert line["message"] == "GET / 200"
    assert line["status"] == 200
    assert line["level"] == "INFO"
    assert line["time"].endswith("Z")


def test_a_quantile_is_interpolated_within_its_bucket() -> None:
    from app.ops.metrics import Histogram

    histogram = Histogram((0.1, 0.5, 1.0))
    assert histogram.quantile(0.5) is None
    for seconds in (0.3, 0.3, 0.3, 0.3):  # all in (0.1, 0.5]
        histogram.observe(seconds)
    assert histogram.quantile(0.5) == pytest.approx(0.3)  # halfway through the bucket
    assert histogram.quantile(1.0) == pytest.approx(0.5)
    histogram.observe(5.0)  # past the last bound
    assert histogram.quantile(1.0) == 1.0


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_nothing_a_client_sends_cuts_or_forges_a_log_line(log_format: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A path or doc id with CR/LF, ANSI escapes, U+0085 or U+2028 stays on its one line (text: escapes;
    JSON: JSON escapes that read back as sent); a UTF-8 doc id reads as itself."""
    from app.ops.logs import RequestLog, configure

    path = "/x\n2026-12-01 15:00:00,000 ERROR app.service.app: forged\x1b[2J\u2028\x85 y"
    doc_id = "doc-é-日本\u2028"
    configure("info", log_format)
    try:
        RequestLog(1).write("GET", path, 404, "", [(b"x-doc-id", doc_id.encode())], None, 0.001)
    finally:
        logging.getLogger().handlers.clear()
    written = capsys.readouterr().err
    assert len(written.splitlines()) == 1, written
    assert "\x1b" not in written
    if log_format == "json":
        line = json.loads(written)
        assert line["path"] == path
        assert line["doc_id"] == doc_id
    else:
        assert "doc-é-日本" in written
        assert "forged" in written  # shown, escaped, on the request's own line


async def test_an_upstreams_own_x_cache_on_a_forwarded_route_is_not_counted_as_the_proxys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache in front of the upstream may say X-Cache: HIT; only the proxy's own outcomes are counted
    (and only its own hits are logged 1 in log_hits_every)."""

    async def cache_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"application/json"), (b"x-cache", b"HIT")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    caplog.set_level(logging.INFO, logger="inferproxy.access")
    async with serve_in_loop(cache_upstream) as url:
        settings = Settings(upstream=[url], checkpoints_dir=tmp_path / "ckpt", log_hits_every=0)
        async with serve_proxy(settings) as proxy, httpx.AsyncClient(base_url=proxy) as client:
            forwarded = await client.get("/version")
            scraped = (await client.get("/metrics")).text
    assert forwarded.headers["x-cache"] == "HIT"  # passed on as it came
    assert 'cache="HIT"' not in scraped
    assert 'inferproxy_requests_total{cache="",route="/{path...}",status="200"} 1.0' in scraped
    assert [getattr(r, "request")["path"] for r in caplog.records if r.name == "inferproxy.access"] == [  # noqa: B009
        "/version",
        "/metrics",
    ]


async def test_a_finished_job_whose_last_chunk_is_short_shows_its_total_done_not_a_full_chunk_more(env: Env) -> None:
    """The README walk-through: 500 documents in chunks of 6000 showed `6k / 500`."""
    documents = [{"id": f"d{i}", "text": "t"} for i in range(10)]
    report = await run_job(documents, env.rollout, base_url=env.proxy, records_per_chunk=4, concurrency=2)
    assert report.written == 10
    await env.client.get("/resume", headers={"X-Total-Documents": "10"})  # a rerun asks where to resume
    view = next(r for r in (await env.stats())["ranks"] if r["rank"] == 0)
    assert view["done_documents"] == 10
    assert view["progress"] == 1.0
    assert view["last_chunk_index"] == 2


async def test_a_rank_whose_last_chunk_completes_is_finished_and_the_job_once_every_declared_rank_is(
    env: Env,
) -> None:
    for rank_ in (0, 1):  # a job of two ranks (datatrove's world_size), no total declared
        answer = await env.client.get("/resume", headers={"X-Rank": str(rank_), "X-Total-Ranks": "2"})
        assert answer.status_code == 200
    job = (await env.stats())["job"]
    assert job == {"ranks_declared": 2, "ranks_finished": 0, "finished": False}

    docs = [{"id": f"d{i}", "text": "t"} for i in range(6)]  # chunks 0 (4) and 1 (2)
    headers = {"X-Rank": "0", "X-Chunk-Index": "0"}
    assert (await env.client.post("/documents", json=docs[:4], headers=headers)).status_code == 200
    headers["X-Chunk-Index"] = "1"
    assert (await env.client.post("/documents", json=docs[4:], headers=headers)).status_code == 200
    view = next(r for r in (await env.stats())["ranks"] if r["rank"] == 0)
    assert (view["finished"], view["finished_at"], view["total_documents"]) == (False, None, None)

    assert (await env.client.post("/chunks/1/complete", headers={"X-Rank": "0"})).status_code == 200
    stats = await env.stats()
    view = next(r for r in stats["ranks"] if r["rank"] == 0)
    assert view["finished"] is True
    assert view["finished_at"] <= stats["now"]
    assert (view["done_documents"], view["total_documents"], view["progress"], view["eta_s"]) == (6, 6, 1.0, 0.0)
    assert view["last_chunk_index"] == 1
    assert stats["job"] == {"ranks_declared": 2, "ranks_finished": 1, "finished": False}
    scraped = await env.scrape()
    assert scraped[("inferproxy_rank_finished", rank())] == 1.0
    assert scraped[("inferproxy_job_ranks", ())] == 2.0
    assert scraped[("inferproxy_job_ranks_finished", ())] == 1.0
    assert scraped[("inferproxy_job_finished", ())] == 0.0

    # The other rank declares its total as it completes its last chunk (the job knows it at the end).
    one = {"X-Rank": "1", "X-Chunk-Index": "0"}
    assert (await env.client.post("/documents", json=docs[:3], headers=one)).status_code == 200
    assert (await env.client.get("/stats")).json()["job"]["finished"] is False
    done = await env.client.post("/chunks/0/complete", headers={"X-Rank": "1", "X-Total-Documents": "3"})
    assert done.status_code == 200
    stats = await env.stats()
    assert [(r["rank"], r["finished"], r["done_documents"], r["total_documents"]) for r in stats["ranks"]] == [
        (0, True, 6, 6),
        (1, True, 3, 3),
    ]
    assert stats["job"] == {"ranks_declared": 2, "ranks_finished": 2, "finished": True}
    scraped = await env.scrape()
    assert scraped[("inferproxy_job_finished", ())] == 1.0
    assert scraped[("inferproxy_rank_finished", rank(rank="1"))] == 1.0

    # A new run on rank 0 writes to it again: no longer finished, nor is the job.
    again = {"X-Rank": "0", "X-Chunk-Index": "2"}
    assert (await env.client.post("/documents", json=[{"id": "new", "text": "t"}], headers=again)).status_code == 200
    stats = await env.stats()
    assert next(r for r in stats["ranks"] if r["rank"] == 0)["finished"] is False
    assert stats["job"] == {"ranks_declared": 2, "ranks_finished": 1, "finished": False}


async def test_completing_a_chunk_before_the_last_published_one_does_not_finish_the_rank(env: Env) -> None:
    docs = [{"id": f"d{i}", "text": "t"} for i in range(3)]
    assert (
        await env.client.post("/documents", json=docs, headers={"X-Rank": "0", "X-Chunk-Index": "1"})
    ).status_code == 200
    answer = await env.client.post("/chunks/1/complete", headers={"X-Rank": "0"})
    assert answer.json()["last_chunk_index"] == -1  # chunk 0 never came: nothing published
    view = next(r for r in (await env.stats())["ranks"] if r["rank"] == 0)
    assert view["finished"] is False


@pytest.mark.parametrize(("value", "says"), [("0", "at least 1"), ("2", "X-Rank is 2"), ("two", "integer")])
async def test_a_bad_declared_number_of_ranks_is_refused(env: Env, value: str, says: str) -> None:
    answer = await env.client.get("/resume", headers={"X-Rank": "2", "X-Total-Ranks": value})
    assert answer.status_code == 400
    assert "X-Total-Ranks" in answer.json()["error"]["message"]
    assert says in answer.json()["error"]["message"]
    assert (await env.stats())["job"]["ranks_declared"] is None


async def test_run_job_declares_the_jobs_ranks_and_its_inputs_length_at_the_end(env: Env) -> None:
    documents = iter([{"id": f"d{i}", "text": "t"} for i in range(5)])  # no length: no total up front
    report = await run_job(documents, env.rollout, base_url=env.proxy, rank=0, total_ranks=1, concurrency=2)
    assert report.written == 5
    stats = await env.stats()
    [view] = stats["ranks"]
    assert (view["finished"], view["done_documents"], view["total_documents"]) == (True, 5, 5)
    assert stats["job"] == {"ranks_declared": 1, "ranks_finished": 1, "finished": True}
    with pytest.raises(ValueError, match=r"rank 1 is not one of the job's ranks 0\.\.0"):
        await run_job([], env.rollout, base_url=env.proxy, rank=1, total_ranks=1)

"""The live page at `GET /`, in headless Chromium, against a real proxy and the fake upstream on loopback ports:
it shows a running job's numbers (the same as `/stats`), asks for the API key, survives the proxy going away,
and stays usable with hundreds of ranks; never a console error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

import app
from app.job.client import ProxyJob
from app.service.app import create_server
from app.tools import status
from tests.browser import ROWS, Browser, text_of, wait_text
from tests.jobs import proxy_finding_chunks_lost, publish_chunks, run_rank, settings, write_chunks
from tests.servers import fake_upstream, serve_proxy
from tests.service.test_batches import CHAT, chat_line, final, put_file, stats_until, until


async def test_the_page_shows_a_running_jobs_numbers_as_stats_does(
    chrome: Browser, tmp_path: Path, http_server: str
) -> None:
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        page = await chrome.open(proxy + "/")
        await wait_text(page, "documents-done-sub", "no job yet")
        assert (await page.evaluate(text_of("connection"))).startswith("live")

        # The page was opened before the job: what it shows next comes from its polling.
        finished = await run_rank(proxy, 0, 12, total=12, cached=4)
        partial = await run_rank(proxy, 1, 8, total=20)
        assert (finished.written, partial.written) == (12, 8)
        async with httpx.AsyncClient(base_url=proxy) as client:
            # chunks are published beside the writes: compared once every completed chunk is (4 + 4 + 4, 4 + 4)
            while True:
                stats = (await client.get("/stats")).json()
                if sorted(r["chunks_published"] for r in stats["ranks"]) == [2, 3]:
                    break
                await asyncio.sleep(0.05)
        totals = stats["totals"]
        assert totals["hits"] == 4
        # a poll after both ranks' documents (one between the two showed rank 0's hit ratio, final, and 12)
        await wait_text(page, "documents-done", "20 / 32")
        await wait_text(page, "hit-ratio", status.percent(totals["hit_ratio"]))
        assert float(await page.evaluate("document.getElementById('hit-ratio').dataset.value")) == totals["hit_ratio"]
        assert await page.evaluate(text_of("tokens-saved")) == status.count(totals["tokens_saved"])
        assert await page.evaluate(text_of("generations-saved")) == "4"
        assert await page.evaluate(text_of("version")) == stats["version"]

        # the page's poll after the last publication
        rows = await page.wait_for(f"(rows => rows[1] && rows[1].chunks === '2' && rows)({ROWS})")
        assert [(r["rank"], r["done"]) for r in rows] == [(0, "12 / 12 · 100.0%"), (1, "8 / 20 · 40.0%")]
        assert rows[0]["eta"] == "finished"  # its last chunk published (rank 1's is still open)
        assert rows[1]["eta"] != "finished"
        assert rows[0]["chunks"] == "3"  # 4 + 4 + 4
        rank1 = next(r for r in stats["ranks"] if r["rank"] == 1)
        assert rows[1]["chunks"] == str(rank1["chunks_published"])

        # Least done first: rank 1 (40%) before rank 0 (finished).
        await page.evaluate(
            "const s = document.getElementById('sort'); s.value = 'progress'; s.dispatchEvent(new Event('change'))"
        )
        assert [r["rank"] for r in await page.evaluate(ROWS)] == [1, 0]

        replica = await page.evaluate("[...document.querySelector('#replicas tbody tr').cells].map(c => c.textContent)")
        assert replica[:2] == [url, "healthy"]
        assert replica[3] == status.count(stats["upstreams"][0]["requests"])

        # Both charts draw a line once two polls have answered (history's first sample, then the page's own).
        await page.wait_for("document.querySelectorAll('#chart-ratio polyline, #chart-tokens polyline').length === 2")
        await page.screenshot(tmp_path / "page.png")
        assert (tmp_path / "page.png").read_bytes().startswith(b"\x89PNG")
        assert page.errors == []
        # Nothing but the page and its polls of /stats: no other resource, from anywhere.
        assert set(page.requests) == {proxy + "/", proxy + "/stats"}


async def test_a_finished_datatrove_job_shows_every_rank_finished_and_the_job_finished(
    chrome: Browser, tmp_path: Path
) -> None:
    """The issue: a finished run showed "released", "0 finished" and "(no total declared)"."""
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        page = await chrome.open(proxy + "/")
        await wait_text(page, "documents-done-sub", "no job yet")
        assert await page.evaluate("document.getElementById('job-card').hidden")

        # As ProxyInferenceRunner runs a datatrove job of 2 tasks: world_size declared, no total, each rank's
        # documents written, then its last chunk completed with the input's length.
        sizes = {0: 6, 1: 3}
        for rank, size in sizes.items():
            job = ProxyJob(proxy, rank, total_ranks=2)
            try:
                state = await job.resume()
                docs = [{"id": f"r{rank}-{i}", "text": "t"} for i in range(size)]
                for i, doc in enumerate(docs):
                    await job.write_document(doc, i // state.records_per_chunk)
                if rank == 0:  # rank 1 still running: the job is not finished yet
                    await job.complete_chunk((size - 1) // state.records_per_chunk, total_documents=size)
                    await wait_text(page, "job-sub", "job running: 1 of 2 ranks finished")
                    assert await page.evaluate(text_of("job")) == "1 / 2"
                    continue
                await job.complete_chunk((size - 1) // state.records_per_chunk, total_documents=size)
            finally:
                await job.close()

        await wait_text(page, "job-sub", "job finished: 2 of 2 ranks")
        assert await page.evaluate(text_of("job")) == "finished"
        rows = await page.evaluate(ROWS)
        assert [(r["rank"], r["done"], r["eta"]) for r in rows] == [
            (0, "6 / 6 · 100.0%", "finished"),
            (1, "3 / 3 · 100.0%", "finished"),
        ]
        classes = await page.evaluate("[...document.querySelectorAll('#ranks tbody tr')].map(row => row.className)")
        assert classes == ["finished", "finished"]  # not "released": the rank is given up because it is done
        label = "getComputedStyle(document.querySelector('#ranks tbody tr td'), '::after').content"
        assert await page.evaluate(label) == '" finished"'
        assert await page.evaluate(text_of("documents-done")) == "9 / 9"
        assert await page.evaluate(text_of("documents-done-sub")) == "100.0% · finished · 2 of 2 ranks seen finished"
        assert (await page.evaluate(text_of("ranks-summary"))).startswith("2 · 0 owned here · 2 finished")
        header = await page.evaluate("document.querySelector('#ranks thead th:nth-child(5)').textContent")
        assert header == "Published here"  # this process's, not the rank's (Last chunk + 1)
        async with httpx.AsyncClient(base_url=proxy) as client:
            job_stats = (await client.get("/stats")).json()["job"]
        assert await page.evaluate(text_of("job-sub")) == status.job_line(job_stats)
        assert page.errors == []


async def test_a_proxy_with_an_api_key_serves_the_page_which_asks_for_the_key_once(
    chrome: Browser, tmp_path: Path
) -> None:
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url, api_key="sekrit")) as proxy:
        async with httpx.AsyncClient(base_url=proxy) as client:
            served = await client.get("/")  # the page holds no numbers: served without the key
            assert served.status_code == 200
            assert served.headers["content-type"].startswith("text/html")
            assert (await client.get("/stats")).status_code == 401
        await run_rank(proxy, 0, 4, total=4, api_key="sekrit")

        page = await chrome.open(proxy + "/")
        await wait_text(page, "connection", "needs the API key")
        assert not await page.evaluate("document.getElementById('auth').hidden")

        async def enter(key: str) -> None:
            await page.evaluate(
                f"document.getElementById('api-key').value = {json.dumps(key)};"
                "document.getElementById('auth-form').requestSubmit()"
            )

        await enter("wrong")
        await wait_text(page, "auth-message", "The proxy refused this key (401): enter it again.")
        assert await page.evaluate("sessionStorage.getItem('inferproxy.apiKey')") is None

        await enter("sekrit")
        await page.wait_for("document.querySelectorAll('#ranks tbody tr').length === 1")
        assert await page.evaluate("document.getElementById('auth').hidden")
        assert await page.evaluate("sessionStorage.getItem('inferproxy.apiKey')") == "sekrit"

        # A reload in the same tab asks for nothing.
        page.errors.clear()
        await page.goto(proxy + "/")
        await page.wait_for(f"{text_of('connection')}.startsWith('live')")
        assert page.errors == []


async def test_the_page_keeps_its_numbers_while_the_proxy_is_away_and_picks_up_again(
    chrome: Browser, tmp_path: Path
) -> None:
    async with fake_upstream() as (url, _):
        first = settings(tmp_path, url)
        async with serve_proxy(first) as proxy:
            await run_rank(proxy, 0, 8, total=10)
            page = await chrome.open(proxy + "/")
            await page.wait_for("document.querySelectorAll('#ranks tbody tr').length === 1")
        # The proxy has shut down: the page says so, and still shows the last numbers.
        await page.wait_for(f"{text_of('connection')}.startsWith('disconnected, retrying')")
        assert await page.evaluate("document.body.classList.contains('stale')")
        rows = await page.evaluate(ROWS)
        assert [(r["rank"], r["done"]) for r in rows] == [(0, "8 / 10 · 80.0%")]
        assert page.errors  # Chromium logs each refused connection
        assert all("ERR_CONNECTION_REFUSED" in error for error in page.errors), page.errors

        # A new proxy on the same port, over the same checkpoints: the page carries on by itself.
        port = int(proxy.rsplit(":", 1)[1])
        server = create_server(first.model_copy(update={"host": "127.0.0.1", "port": port, "http": "builtin"}))
        await server.start()
        try:
            await page.wait_for(f"{text_of('connection')}.startsWith('live')")
            assert not await page.evaluate("document.body.classList.contains('stale')")
            # Done documents come from the checkpoints; the new process has no counters for rank 0 yet.
            await wait_text(page, "documents-done", "0")
        finally:
            await server.shutdown()


async def test_hundreds_of_ranks_stay_one_sortable_scrolling_table(chrome: Browser, tmp_path: Path) -> None:
    ranks = 300
    async with (
        fake_upstream() as (url, _),
        serve_proxy(settings(tmp_path, url, max_open_ranks=ranks + 10)) as proxy,
        httpx.AsyncClient(base_url=proxy, timeout=60) as client,
    ):
        for rank in range(ranks):
            declared = await client.get("/resume", headers={"X-Rank": str(rank), "X-Total-Documents": str(rank + 1)})
            assert declared.status_code == 200
        # One document on each of ranks 0..29: rank r is 1/(r+1) done, the others not started.
        for rank in range(30):
            doc = {"id": f"r{rank}", "text": "t"}
            written = await client.post("/documents", json=doc, headers={"X-Rank": str(rank), "X-Chunk-Index": "0"})
            assert written.status_code == 200
        page = await chrome.open(proxy + "/", height=900)
        await page.wait_for(f"document.querySelectorAll('#ranks tbody tr').length === {ranks}")
        rows = await page.evaluate(ROWS)
        assert [r["rank"] for r in rows] == list(range(ranks))
        assert rows[0]["done"] == "1 / 1 · 100.0%"
        assert rows[299]["done"] == "0 / 300 · 0.0%"

        await page.evaluate(
            "const s = document.getElementById('sort'); s.value = 'progress'; s.dispatchEvent(new Event('change'))"
        )
        order = [r["rank"] for r in await page.evaluate(ROWS)]
        assert order[:3] == [30, 31, 32]  # not started, by rank
        assert order[-3:] == [2, 1, 0]  # 33%, 50%, 100%
        # The table scrolls inside its box under a header that stays; the choice of sort survives a reload.
        assert await page.evaluate(
            "(() => { const s = document.getElementById('ranks-scroll'); return s.scrollHeight > s.clientHeight })()"
        )
        assert await page.evaluate("getComputedStyle(document.querySelector('#ranks th')).position") == "sticky"
        await page.goto(proxy + "/")
        await page.wait_for(f"document.querySelectorAll('#ranks tbody tr').length === {ranks}")
        assert (await page.evaluate(ROWS))[0]["rank"] == 30
        assert page.errors == []


async def test_ranks_forgotten_past_max_tracked_ranks_are_said_apart_from_the_table(
    chrome: Browser, tmp_path: Path
) -> None:
    # The totals hold the forgotten ranks' counts and the table does not: the page says which is which.
    async with (
        fake_upstream() as (url, _),
        serve_proxy(settings(tmp_path, url, max_open_ranks=2, max_tracked_ranks=2)) as proxy,
        httpx.AsyncClient(base_url=proxy, timeout=60) as client,
    ):
        for rank in range(6):  # each opens its rank; past 2 open, the least recently used is let go
            assert (await client.get("/resume", headers={"X-Rank": str(rank)})).status_code == 200
        page = await chrome.open(proxy + "/", height=900)
        # The proxy forgets within its next tick (every 5 s), the page shows it at its next poll.
        await page.wait_for("document.getElementById('ranks-summary').textContent.includes('forgotten')")
        summary = await page.evaluate("document.getElementById('ranks-summary').textContent")
        shown = await page.evaluate("document.querySelectorAll('#ranks tbody tr').length")
        assert (
            summary == f"{shown} · 2 owned here · 0 finished · {6 - shown} more forgotten past max_tracked_ranks "
            "(in the totals above only)"
        )
        assert shown == 2
        assert await page.evaluate("document.getElementById('ranks-empty').hidden")
        assert page.errors == []


NUMBERS = [None, 0, 0.004, 0.5, 0.9996, 1, 1.25, 9.995, 12.35, 99.95, 999, 999.5, 1000, 1250, 99_949, 99_960, 59.5]
NUMBERS += [999_400, 999_950, 3_456_789, 12_345_678_901, 3599.4, 7380, 86_399.6, 90_000, 1e15, 5e18]
NUMBERS += [-5, 999.96, 4000, 999e15, 2.0**64, 86_399_999, 86_400_000, 1e308]  # absurd, from a hostile /stats
RATIOS = [None, 0, 0.00049, 0.1235, 0.6667, 0.99951, 1, -5, 7]


async def test_the_page_formats_numbers_as_inferproxy_status_does(chrome: Browser, tmp_path: Path) -> None:
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        page = await chrome.open(proxy + "/")
        cases = {name: NUMBERS for name in ("count", "duration", "rate", "latency", "size")} | {"percent": RATIOS}
        for name, values in cases.items():
            shown = await page.evaluate(f"{json.dumps(values)}.map(v => {name}(v))")
            assert shown == [getattr(status, name)(v) for v in values], name
        assert page.errors == []


# -- a rank's chunks and the output ---------------------------------------------------------------

NOTES = """[...document.querySelectorAll('#publications-list li')].map(li => ({
    kind: li.className, text: li.textContent, error: li.querySelector('code')?.textContent ?? null}))"""
BADGES = """Object.fromEntries([...document.querySelectorAll('#ranks tbody tr')].map(row => [row.dataset.rank,
    {chunks: row.cells[4].textContent, row: row.className,
     badges: [...row.querySelectorAll('.badge')].map(b => b.className + ': ' + b.textContent)}]))"""


async def test_the_page_says_which_ranks_chunks_wait_for_the_output_and_why_and_which_are_lost(
    chrome: Browser, tmp_path: Path
) -> None:
    (tmp_path / "out").write_text("a file where the output folder should be")  # every publication fails
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url, publish_retry_max_s=1)) as proxy:
        await write_chunks(proxy, 0, range(2))  # rank 0: published, before the output fails
        await write_chunks(proxy, 3, range(1))
        page = await chrome.open(proxy + "/")
        await page.wait_for("!document.getElementById('publications').hidden")
        assert await page.evaluate(text_of("publications-title")) == "Chunks waiting for the output"
        summary = "publications failing on 2 ranks, retried in the background"
        assert await page.evaluate(text_of("publications-summary")) == summary
        notes = await page.evaluate(NOTES)
        assert [n["kind"] for n in notes] == ["failing", "failing"]
        assert notes[1]["text"].startswith("rank 3: 1 chunk waiting for the output since ")
        assert " attempt" in notes[1]["text"]
        assert notes[1]["error"].startswith("publishing 00003_chunk_0.jsonl failed: [Errno 20] Not a directory: ")
        rows = await page.evaluate(BADGES)
        assert rows["3"] == {"chunks": "0 1 waiting", "row": "failing", "badges": ["badge waiting: 1 waiting"]}

        # The output back: the chunks are published at the next try, and the page says nothing more of it.
        (tmp_path / "out").unlink()
        await page.wait_for("document.getElementById('publications').hidden")
        await page.wait_for("document.querySelector('#ranks tr[data-rank=\"3\"]').cells[4].textContent === '1'")
        assert (await page.evaluate(BADGES))["3"] == {"chunks": "1", "row": "", "badges": []}
        assert page.errors == []
        await publish_chunks(proxy, 3, range(1, 3))

    # The output loses chunks 0 and 2 while nobody runs; the next proxy finds out when the rank comes back.
    async with proxy_finding_chunks_lost(tmp_path, 3, (0, 2)) as proxy:
        page = await chrome.open(proxy + "/")
        await page.wait_for("!document.getElementById('publications').hidden")
        assert await page.evaluate("document.getElementById('publications').className") == "lost"
        assert await page.evaluate(text_of("publications-title")) == "Chunks missing from the output"
        assert await page.evaluate(text_of("publications-summary")) == "1 rank refused by GET /resume"
        line = "rank 3: chunks [0, 2] are missing from the output: GET /resume refuses the rank (see the proxy's log)"
        assert await page.evaluate(NOTES) == [{"kind": "lost", "text": line, "error": None}]
        rows = await page.evaluate(BADGES)
        assert rows["3"] == {"chunks": "0 2 LOST", "row": "released lost", "badges": ["badge lost: 2 LOST"]}
        assert page.errors == []


@contextlib.asynccontextmanager
async def canned_stats(stats: dict[str, Any]) -> AsyncIterator[str]:
    """The page at `/` and `stats` as given (changed in place, it is answered as it is then): what no proxy
    of this version sends (an older proxy's /stats, hostile strings)."""
    page_html = (Path(app.__file__).parent / "service" / "static" / "page.html").read_bytes()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            body, kind = (
                (json.dumps(stats).encode(), b"application/json") if path == b"/stats" else (page_html, b"text/html")
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nCache-Control: no-store\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


PUBLICATION_KEYS = (
    "chunks_waiting",
    "publication_error",
    "publication_failing_since",
    "publication_attempts",
    "publication_retry_in_s",
    "chunks_lost",
)


async def test_an_error_from_stats_is_shown_as_text_and_an_older_proxys_stats_as_before(
    chrome: Browser, tmp_path: Path
) -> None:
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        await write_chunks(proxy, 0, range(1))
        async with httpx.AsyncClient(base_url=proxy) as client:
            assert (await client.get("/resume", headers={"X-Rank": "0"})).json()["last_chunk_index"] == 0  # published
            stats = (await client.get("/stats")).json()
    [rank] = stats["ranks"]
    # A proxy from before publications in the background: none of these keys.
    older = {key: value for key, value in rank.items() if key not in PUBLICATION_KEYS}
    stats["ranks"] = [older]
    async with canned_stats(stats) as served:
        page = await chrome.open(served + "/")
        await page.wait_for("document.querySelectorAll('#ranks tbody tr').length === 1")
        assert await page.evaluate(BADGES) == {"0": {"chunks": "1", "row": "", "badges": []}}
        assert await page.evaluate("document.getElementById('publications').hidden")

        hostile = "<img src=x onerror=\"document.title='PWNED'\"></code><b>disk</b> full"
        stats["ranks"] = [{**rank, "chunks_waiting": 3, "publication_error": hostile, "publication_attempts": 2}]
        await page.wait_for("!document.getElementById('publications').hidden")
        [note] = await page.evaluate(NOTES)
        assert note["error"] == hostile
        assert note["text"] == "rank 0: 3 chunks waiting for the output (2 attempts): " + hostile
        assert await page.evaluate("document.querySelectorAll('#publications img, #publications b').length") == 0
        assert await page.evaluate("document.querySelector('#ranks .badge.waiting').title") == (
            "3 complete chunks not yet published to the output; publishing fails: " + hostile
        )
        assert await page.evaluate("document.title") == "inferproxy"
        assert page.errors == []


async def test_the_page_says_of_the_output_what_inferproxy_status_says(chrome: Browser, tmp_path: Path) -> None:
    now = time.time()
    failing = {
        "rank": 3,
        "chunks_waiting": 2,
        "publication_error": "publishing 00003_chunk_4.jsonl failed: [Errno 28] No space left on device",
        "publication_failing_since": now - 610,
        "publication_attempts": 5,
        "publication_retry_in_s": 30.4,
        "chunks_lost": [],
    }
    ranks: list[dict[str, Any]] = [
        failing,
        {**failing, "rank": 4, "chunks_waiting": 1, "publication_attempts": 1, "publication_retry_in_s": 0.0},
        {**failing, "rank": 5, "publication_failing_since": now - 3 * 86_400, "publication_retry_in_s": None},
        {**failing, "rank": 6, "publication_failing_since": None, "chunks_waiting": 1_234_567},
        {"rank": 7, "chunks_waiting": 1, "chunks_lost": [0, 2]},  # lost: first, whatever its rank
        {"rank": 1, "chunks_lost": [4]},
        {"rank": 8, "chunks_lost": list(range(3, 30))},
        {"rank": 0, "chunks_waiting": 4},  # waiting for a slow output: nothing failed
        {"rank": 2},  # a proxy from before these keys
    ]
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        page = await chrome.open(proxy + "/")
        shown = await page.evaluate(f"publicationNotes({json.dumps(ranks)}, {now}).map(n => n.text + n.error)")
        assert shown == status.publication_notes(ranks, now)
        assert len(shown) == 7
        assert page.errors == []


async def test_the_two_charts_share_one_time_axis_though_the_ratio_has_no_point_before_the_first_answer(
    chrome: Browser, tmp_path: Path
) -> None:
    # The ratio chart started at the first answered request, the tokens chart at the first sample.
    async with (
        fake_upstream() as (url, _),
        serve_proxy(settings(tmp_path, url)) as proxy,
        httpx.AsyncClient(base_url=proxy) as client,
    ):
        stats = (await client.get("/stats")).json()
    now, totals = stats["now"], stats["totals"]
    idle = {**totals, "hits": 0, "coalesced": 0, "misses": 0, "refreshed": 0, "tokens_saved": 0}
    answered = {**idle, "hits": 3, "misses": 1, "tokens_saved": 40}
    stats["history"] = [{**idle, "t": now - 1200}, {**answered, "t": now - 600}, {**answered, "t": now - 300}]
    stats["totals"] = {**totals, **{k: answered[k] for k in ("hits", "misses", "tokens_saved")}}
    async with canned_stats(stats) as served:
        page = await chrome.open(served + "/")
        await page.wait_for("document.querySelectorAll('#chart-ratio polyline, #chart-tokens polyline').length === 2")
        starts = await page.evaluate(
            "['chart-ratio', 'chart-tokens'].map((id) => [...document.querySelectorAll(`#${id} text`)]"
            ".map((t) => t.textContent).find((text) => text.endsWith(' ago')))"
        )
        assert starts[0] == starts[1], starts
        assert starts[0].startswith("20"), starts  # from the first sample, 20 minutes back
        assert page.errors == []


async def test_the_batches_a_proxy_runs_are_a_table_as_inferproxy_status_shows_them(
    chrome: Browser, tmp_path: Path
) -> None:
    async with (
        fake_upstream() as (url, _),
        serve_proxy(settings(tmp_path, url)) as proxy,
        httpx.AsyncClient(base_url=proxy) as client,
    ):
        stats = (await client.get("/stats")).json()
    assert stats["batches"] == []
    async with canned_stats(stats) as served:
        page = await chrome.open(served + "/")
        await page.wait_for("document.getElementById('replicas-summary').textContent !== ''")
        assert await page.evaluate("document.getElementById('batches-section').hidden")
        hostile = "<img src=x onerror=\"document.title='PWNED'\">"
        stats["batches"] = [
            {
                "id": hostile,
                "status": "in_progress",
                "total": 2000,
                "completed": 480,
                "failed": 20,
                "in_flight": 16,
                "usage": {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3},
                "hits": 7,
                "lines_per_s": 12.5,
                "eta_s": 120.0,
            }
        ]
        await page.wait_for("!document.getElementById('batches-section').hidden")
        cells = await page.evaluate("[...document.querySelector('#batches tbody tr').cells].map(c => c.textContent)")
        assert cells == [hostile, "in_progress", "500 / 2k · 25.0%", "20", "16", "7", status.rate(12.5), "2m 00s"]
        assert await page.evaluate(text_of("batches-summary")) == "1 running here · 2k lines"
        why = "the checkpoints disk is full (No space left on device): free space under /ckpt"
        stats["batches"][0]["paused"] = why
        shown = await page.wait_for("document.querySelector('#batches tbody td.paused')?.textContent")
        assert shown == f"in_progress · paused: {why}"
        assert await page.evaluate("document.querySelectorAll('#batches img').length") == 0
        assert await page.evaluate("document.title") == "inferproxy"
        assert page.errors == []


async def test_a_proxy_whose_batch_ended_says_so_where_it_said_no_job(chrome: Browser, tmp_path: Path) -> None:
    """Once its batch ended, the page said "no job yet": /stats' `batches` holds the running ones only."""
    async with (
        fake_upstream() as (url, _),
        serve_proxy(settings(tmp_path, url)) as proxy,
        httpx.AsyncClient(base_url=proxy) as client,
    ):
        file_id = put_file(tmp_path / "ckpt", [chat_line(f"k{i}", f"q{i}") for i in range(3)])
        created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
        await until(client, created.json()["id"], final)
        stats = await stats_until(client, lambda s: not s["batches"] and s["batches_done"]["completed"] == 1)
        line = "batches: 1 completed (GET /v1/batches)"
        assert status.batches_done_line(stats["batches_done"]) == line  # what `inferproxy status` shows
        page = await chrome.open(proxy + "/")
        await wait_text(page, "documents-done-sub", line)
        assert await page.evaluate(text_of("batches-summary")) == line
        assert await page.evaluate("!document.getElementById('batches-section').hidden")
        assert await page.evaluate("document.getElementById('batches').hidden")  # no batch running: no table
        assert await page.evaluate(text_of("ranks-empty")) == (
            "No rank has talked to this proxy since it started: only batches (below)."
        )
        assert page.errors == []

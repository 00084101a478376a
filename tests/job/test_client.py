"""ProxyJob and run_job against a real proxy on a loopback port (in this event loop), with the openai client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from app.checkpoints.documents import DocumentLike
from app.http.client import HTTPClient, ReadTimeout
from app.job.client import ProxyJob, ProxyJobError
from app.job.run import run_job
from app.service.app import create_app
from app.service.settings import Settings
from app.tools.fake_upstream import FakeUpstream
from tests.canned import canned_server
from tests.servers import fake_upstream, serve_in_loop


class Env:
    def __init__(self, proxy: str, upstream: FakeUpstream, tmp_path: Path, heads: list[tuple[str, Any]]) -> None:
        self.proxy = proxy
        self.upstream = upstream
        self.out = tmp_path / "out"
        self.states: list[str] = []
        self.heads = heads  # each request the proxy got: "METHOD /path" and its headers

    def sent(self, route: str, header: bytes) -> list[bytes | None]:
        """The values of `header` in the requests `route` ("GET /resume") got, None where it was absent."""
        return [dict(headers).get(header) for head, headers in self.heads if head == route]

    async def rollout(self, document: DocumentLike, rollout_idx: int, headers: dict[str, str]) -> str:
        async with openai.AsyncOpenAI(base_url=self.proxy + "/v1", api_key="unused", max_retries=0) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="fake-model",
                messages=[{"role": "user", "content": document.text}],
                max_tokens=4,
                extra_headers=headers,
            )
        self.states.append(raw.headers["x-cache"])
        return raw.parse().choices[0].message.content or ""

    def published(self) -> list[dict[str, Any]]:
        return [json.loads(line) for f in sorted(self.out.glob("*.jsonl")) for line in f.read_text().splitlines()]


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with fake_upstream() as (url, upstream):
        settings = Settings(
            upstream=[url], checkpoints_dir=tmp_path / "ckpt", output=str(tmp_path / "out"), records_per_chunk=4
        )
        app = create_app(settings)
        heads: list[tuple[str, Any]] = []

        async def recording(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                heads.append((f"{scope['method']} {scope['path']}", scope["headers"]))
            await app(scope, receive, send)

        async with serve_in_loop(recording) as proxy:
            yield Env(proxy, upstream, tmp_path, heads)


DOCS = [{"id": f"doc-{i}", "text": f"question {i}"} for i in range(10)]


async def test_run_job_publishes_every_document_once_and_a_rerun_does_nothing(env: Env) -> None:
    report = await run_job(DOCS, env.rollout, base_url=env.proxy, rollouts_per_document=2, concurrency=4)
    assert (report.documents, report.written, report.skipped, report.chunks) == (10, 10, 0, 3)
    published = env.published()
    assert sorted(d["id"] for d in published) == [d["id"] for d in DOCS]
    assert all(len(d["metadata"]["rollout_results"]) == 2 for d in published)
    assert env.upstream.generations == 20

    again = await run_job(DOCS, env.rollout, base_url=env.proxy, rollouts_per_document=2)
    assert (again.written, again.skipped) == (0, 10)
    assert env.upstream.generations == 20


async def test_a_finished_job_run_again_says_at_info_that_it_is_done_and_warns_of_nothing(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    await run_job(DOCS, env.rollout, base_url=env.proxy, progress=False)  # 10 documents: chunks 0-1 full, 2 half
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="app.job"):
        again = await run_job(DOCS, env.rollout, base_url=env.proxy, progress=False)
    assert (again.written, again.skipped) == (0, 10)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records if r.name in ("app.job.client", "app.job.run")]
    assert messages == [("INFO", "rank 0: all 10 documents were already done: nothing to do")]


async def test_an_input_shorter_than_what_the_checkpoints_hold_is_warned_about(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    await run_job(DOCS, env.rollout, base_url=env.proxy, progress=False)
    with caplog.at_level(logging.WARNING, logger="app.job.run"):
        report = await run_job(DOCS[:6], env.rollout, base_url=env.proxy, progress=False)
    assert (report.written, report.skipped) == (0, 6)
    assert "the first 12 documents are done, more than this input has (6)" in caplog.text


async def test_the_total_is_declared_to_the_proxy_when_the_input_has_a_length_or_is_given(env: Env) -> None:
    await run_job(DOCS[:6], env.rollout, base_url=env.proxy, progress=False)
    assert env.sent("GET /resume", b"x-total-documents") == [b"6"]
    assert set(env.sent("POST /documents", b"x-total-documents")) == {b"6"}
    env.heads.clear()
    await run_job(iter(DOCS), env.rollout, base_url=env.proxy, progress=False)  # no length: not declared
    assert env.sent("GET /resume", b"x-total-documents") == [None]
    assert set(env.sent("POST /documents", b"x-total-documents")) == {None}
    env.heads.clear()
    await run_job(iter(DOCS), env.rollout, base_url=env.proxy, progress=False, total_documents=10)
    assert env.sent("GET /resume", b"x-total-documents") == [b"10"]


def _reading(fd: int) -> concurrent.futures.Future[bytes]:
    """Everything read from a pipe or a pty's master until its other end closes, read meanwhile (a
    terminal's buffer is small: a writer nobody reads from would block)."""

    def read() -> bytes:
        data = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty's master reads EIO once its slave is closed
                break
            if not chunk:
                break
            data += chunk
        os.close(fd)
        return data

    return concurrent.futures.ThreadPoolExecutor(1).submit(read)


async def test_on_a_terminal_the_job_redraws_one_progress_line_on_stderr(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    master, slave = os.openpty()
    shown = _reading(master)
    with os.fdopen(slave, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        await run_job(DOCS, env.rollout, base_url=env.proxy, concurrency=2)
    drawn = shown.result(timeout=30).decode()
    assert drawn.startswith("\r")
    assert drawn.endswith("\r\n")  # the line ends with the job (the terminal adds the \r)
    last = drawn.rstrip().rsplit("\r", 1)[-1]
    assert re.fullmatch(r"rank 0 \[#{24}\] 10/10 documents 100% [\d.,]+ docs/s in \d+s", last.rstrip()), last


async def test_off_a_terminal_the_job_draws_nothing_and_logs_its_progress(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    read, write = os.pipe()
    shown = _reading(read)
    with os.fdopen(write, "w") as pipe:
        monkeypatch.setattr(sys, "stderr", pipe)
        with caplog.at_level(logging.INFO, logger="app.job.progress"):
            await run_job(DOCS, env.rollout, base_url=env.proxy, concurrency=2)
    assert shown.result(timeout=30) == b""
    logged = [r.getMessage() for r in caplog.records if r.name == "app.job.progress"]
    assert re.fullmatch(r"rank 0 10/10 documents 100% [\d.,]+ docs/s in \d+s", logged[-1])


async def test_a_job_interrupted_mid_way_resumes_and_replays_what_it_had_generated(env: Env) -> None:
    job = ProxyJob(env.proxy)
    for i in range(6):  # documents 0-5 written by a job that then died
        await job.write_documents([DOCS[i]], i // 4)
    await job.close()
    # the dead job had also generated doc-6's answers
    await env.rollout(_doc(DOCS[6]), 0, ProxyJob(env.proxy).headers("doc-6", 0, 1))
    env.states.clear()
    report = await run_job(DOCS, env.rollout, base_url=env.proxy)
    assert (report.skipped, report.written) == (6, 4)
    assert sorted(env.states) == ["HIT", "MISS", "MISS", "MISS"]
    assert sorted(d["id"] for d in env.published()) == [d["id"] for d in DOCS]


async def test_rollouts_that_return_none_leave_the_document_out_of_the_output(env: Env) -> None:
    async def nothing(document: DocumentLike, rollout_idx: int, headers: dict[str, str]) -> None:
        return None

    report = await run_job(DOCS[:4], nothing, base_url=env.proxy)
    assert report.written == 4
    assert env.published() == []
    assert (await ProxyJob(env.proxy).resume()).last_chunk_index == 0


async def test_a_job_with_another_records_per_chunk_is_told_how_to_fix_it(env: Env) -> None:
    with pytest.raises(ValueError, match="chunks of 4 documents, this job asked for 5"):
        await run_job(DOCS, env.rollout, base_url=env.proxy, records_per_chunk=5)


async def test_service_errors_arrive_as_proxy_job_errors(env: Env) -> None:
    job = ProxyJob(env.proxy, rank=1)
    await job.write_documents([{"id": f"x{i}", "text": "t"} for i in range(4)], 0)
    with pytest.raises(ProxyJobError, match="409: chunk 0 is already complete") as caught:
        await job.write_documents([{"id": "late", "text": "t"}], 0)
    assert caught.value.status == 409
    await job.close()


def _doc(data: dict[str, Any]) -> Any:
    from app.checkpoints.documents import Document

    return Document.from_dict(data)


async def test_a_retry_after_a_lost_answer_that_completed_the_chunk_counts_as_done(env: Env) -> None:
    from app.http.client import ConnectionLost

    job = ProxyJob(env.proxy)
    real_request = job._client.request
    lost = False

    @contextlib.asynccontextmanager
    async def answer_lost_once(method: str, url: str, **kwargs: Any) -> AsyncIterator[Any]:
        nonlocal lost
        async with real_request(method, url, **kwargs) as response:
            if url.endswith("/documents") and not lost:
                lost = True
                await response.read()
                raise ConnectionLost("the proxy died before answering", before_response=True)
            yield response

    job._client.request = answer_lost_once  # type: ignore[method-assign]
    answer = await job.write_documents([{"id": f"d{i}", "text": "t"} for i in range(4)], 0)
    assert answer["duplicates"] == 4
    assert (await job.resume()).last_chunk_index == 0
    await job.close()


async def test_an_id_skipped_on_resume_is_consumed_once_as_datatrove_does(env: Env) -> None:
    job = ProxyJob(env.proxy)
    await job.write_documents([{"id": "x", "text": "first x"}], 1)  # written by a job that then died
    await job.close()
    # chunks of 4: a b c e | x f g h | x i  -- the input repeats id x
    docs = [{"id": "a", "text": "a"}, {"id": "b", "text": "b"}, {"id": "c", "text": "c"}, {"id": "e", "text": "e"}]
    docs += [{"id": "x", "text": "x"}, {"id": "f", "text": "f"}, {"id": "g", "text": "g"}, {"id": "h", "text": "h"}]
    docs += [{"id": "x", "text": "x again"}, {"id": "i", "text": "i"}]
    report = await run_job(docs, env.rollout, base_url=env.proxy)
    assert report.skipped == 1  # only the first x after the resume point
    published = sorted(d["id"] for d in env.published())
    assert published == sorted(["a", "b", "c", "e", "x", "f", "g", "h", "x", "i"])  # both documents named x
    assert (await ProxyJob(env.proxy).resume()).last_chunk_index == 2


async def test_documents_written_together_go_in_few_requests_and_each_caller_learns_its_own_fate(
    tmp_path: Path,
) -> None:
    seen: list[int] = []  # documents per POST /documents the proxy got

    class Counting:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] == "/documents":
                body = b""
                while True:
                    message = await receive()
                    body += message.get("body", b"")
                    if not message.get("more_body"):
                        break
                seen.append(len(json.loads(body)))
                sent = False

                async def replay() -> dict[str, Any]:
                    nonlocal sent
                    if sent:
                        return {"type": "http.disconnect"}
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}

                await self.app(scope, replay, send)
                return
            await self.app(scope, receive, send)

    settings = Settings(
        upstream=["http://127.0.0.1:9"],
        checkpoints_dir=tmp_path / "ckpt",
        output=str(tmp_path / "out"),
        records_per_chunk=100,
    )
    async with serve_in_loop(Counting(create_app(settings))) as proxy:
        job = ProxyJob(proxy)
        good = [{"id": f"d{i}", "text": "t"} for i in range(42)]
        await asyncio.gather(*(job.write_document(d, 0) for d in good[:40]))
        assert seen == [40]  # written together: one request, one fsync at the proxy
        bad = {"id": "", "text": "an empty id is refused"}
        results = await asyncio.gather(
            *(job.write_document(d, 0) for d in [good[40], bad, good[41]]), return_exceptions=True
        )
        assert results[0] is None
        assert results[2] is None
        refused = results[1]
        assert isinstance(refused, ProxyJobError)
        assert refused.status == 400
        assert "id must be a non-empty string" in refused.message
        state = await job.resume()
        await job.close()
    assert state.processed_ids == frozenset(d["id"] for d in good)
    # the proxy takes a batch whole or not at all: refused, its documents went again one by one
    assert seen == [40, 3, 1, 1, 1]


async def test_a_call_whose_answer_stops_midway_closes_its_connection_on_the_read_timeout() -> None:
    async with canned_server([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"]) as upstream:
        job = ProxyJob(upstream.url, client=HTTPClient(read_timeout=0.2))
        with pytest.raises(ReadTimeout):
            await job.resume()
        await asyncio.wait_for(upstream.until_open(0), 5)
        await job.close()

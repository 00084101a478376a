"""app.job.run: run_job against a real proxy on a loopback port (in this event loop), with the openai client."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import sys
from typing import Any

import pytest

from app.checkpoints.documents import DocumentLike
from app.job.client import ProxyJob
from app.job.run import run_job
from tests.job.conftest import Env

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
    assert messages == [
        (
            "INFO",
            "rank 0: resuming: skipping the documents of the chunks published (the first 12 positions: chunks of "
            "4) and 0 more checkpointed since",
        ),
        (
            "INFO",
            "rank 0: all 10 documents were already done: nothing to do (if this is a new job, not a rerun, "
            "give it a checkpoints dir of its own (inferproxy serve --checkpoints-dir): its documents were taken for "
            "the old job's)",
        ),
    ]


async def test_a_job_resumed_part_way_says_at_info_what_it_skips(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    killed = ProxyJob(env.proxy, rank=0)  # a run killed after 5 documents: chunk 0 published, 1 of chunk 1
    await killed.write_documents(DOCS[:4], 0)
    await killed.write_documents(DOCS[4:5], 1)
    await killed.close()
    with caplog.at_level(logging.INFO, logger="app.job.run"):
        report = await run_job(DOCS, env.rollout, base_url=env.proxy, progress=False)
    assert (report.written, report.skipped) == (5, 5)
    assert (
        "rank 0: resuming: skipping the documents of the chunks published (the first 4 positions: chunks of 4) and 1 "
        "more checkpointed since" in caplog.text
    )


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


def _doc(data: dict[str, Any]) -> Any:
    from app.checkpoints.documents import Document

    return Document.from_dict(data)


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

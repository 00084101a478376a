"""Publishing beside the rank's writes: a stalled or failing output, a publication given up, the output
checked against what was published (issue: hand-overs that cannot lose a chunk)."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import app.checkpoints.manager
import app.checkpoints.publish
from app.checkpoints.manager import PublicationBacklog
from app.checkpoints.publish import ChunkPublisher, PublicationAbandoned, PublishError
from app.http.client import HTTPClient
from app.job.client import ProxyJob
from app.service.settings import Settings
from app.store.durable import atomic_write_bytes, temporary_target
from app.tools.status import render
from tests.factories import document, manager
from tests.servers import proxy_client, serve_proxy


def config(tmp_path: Path, **overrides: Any) -> Settings:
    options: dict[str, Any] = {
        "upstream": ["http://127.0.0.1:9"],
        "checkpoints_dir": tmp_path / "ckpt",
        "output": str(tmp_path / "out"),
        "records_per_chunk": 3,
        **overrides,
    }
    return Settings(**options)


def docs(first: int, count: int) -> list[dict[str, str]]:
    return [{"id": f"d{i}", "text": f"text {i}"} for i in range(first, first + count)]


async def post(client: httpx.AsyncClient, chunk: int, body: Any, rank: int = 0) -> httpx.Response:
    return await client.post("/documents", json=body, headers={"X-Rank": str(rank), "X-Chunk-Index": str(chunk)})


class Stall:
    """`ChunkPublisher._publish` held until `release()`: an upload that hangs (a stalled S3, an NFS server
    gone quiet)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        real = ChunkPublisher._publish

        def stalled(publisher: ChunkPublisher, name: str, abandon: threading.Event) -> None:
            self.started.set()
            while not self.go.wait(0.01):
                if abandon.is_set():
                    raise PublicationAbandoned("given up while stalled")
            real(publisher, name, abandon)

        monkeypatch.setattr(ChunkPublisher, "_publish", stalled)

    def release(self) -> None:
        self.go.set()


@pytest.fixture
def stall(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stall]:
    stalled = Stall(monkeypatch)
    yield stalled
    stalled.release()


async def test_a_ranks_writes_are_answered_while_its_upload_is_stalled(tmp_path: Path, stall: Stall) -> None:
    async with proxy_client(config(tmp_path)) as client:
        assert (await post(client, 0, docs(0, 3))).status_code == 200  # completes chunk 0: its upload hangs
        await asyncio.to_thread(stall.started.wait, 10)
        # Without waiting for it: the next chunk's documents are acknowledged while it hangs.
        answer = await asyncio.wait_for(post(client, 1, docs(3, 2)), timeout=10)
        assert (answer.status_code, answer.json()["written"]) == (200, 2)
        assert not stall.go.is_set()
        view = next(r for r in (await client.get("/stats")).json()["ranks"] if r["rank"] == 0)
        assert view["chunks_waiting"] == 1
        stall.release()
        resume = (await client.get("/resume")).json()  # answered once what waits is published
        assert (resume["last_chunk_index"], resume["processed_ids"]) == (0, ["d3", "d4"])
    assert sorted(os.listdir(tmp_path / "out")) == ["00000_chunk_0.jsonl"]


async def test_a_resume_point_asked_while_an_upload_stalls_is_a_503_and_the_job_client_waits_it_out(
    tmp_path: Path, stall: Stall, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /resume (and the last chunk's completion) waited for a stalled publication without bound: a job
    restarted meanwhile hung until its client's read timeout (600 s, a raw ReadTimeout), or for days."""
    monkeypatch.setattr(app.checkpoints.manager, "PUBLICATION_WAIT_S", 0.5)
    async with serve_proxy(config(tmp_path)) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        assert (await post(client, 0, docs(0, 3))).status_code == 200  # completes chunk 0: its upload hangs
        await asyncio.to_thread(stall.started.wait, 10)
        answer = await client.get("/resume")
        assert (answer.status_code, answer.json()["error"]["type"]) == (503, "output_unavailable")
        assert re.search(r"has run for \d+ s without ending \(a stalled output\?\)", answer.json()["error"]["message"])
        assert "retry-after" in answer.headers
        completing = await client.post("/chunks/1/complete")
        assert completing.status_code == 503
        job = ProxyJob(url, client=HTTPClient(read_timeout=3.0))
        resuming = asyncio.create_task(job.resume())  # retried, as a 503 is, until the output is back
        await asyncio.sleep(1.0)  # a few of its 503s
        stall.release()
        try:
            assert (await resuming).last_chunk_index == 1  # chunk 0, then the last, 1, declared complete (empty)
        finally:
            await job.close()


async def test_past_max_waiting_chunks_new_documents_get_503_and_nothing_is_written(
    tmp_path: Path, stall: Stall
) -> None:
    async with proxy_client(config(tmp_path, max_waiting_chunks=2, backlog_wait_s=0.2)) as client:
        for chunk in range(2):
            assert (await post(client, chunk, docs(3 * chunk, 3))).status_code == 200
        refused = await post(client, 2, docs(6, 1))  # after waiting backlog_wait_s for the stalled output
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "output_unavailable"
        assert "max_waiting_chunks=2" in refused.json()["error"]["message"]
        assert "nothing of this request was written" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert not (tmp_path / "ckpt" / "00000" / "chunk_00002.jsonl").exists()
        stall.release()
        assert (await client.get("/resume")).json()["last_chunk_index"] == 1
        assert (await post(client, 2, docs(6, 1))).status_code == 200


async def test_past_max_waiting_chunks_a_write_waits_for_a_slow_output_and_is_taken_once_it_catches_up(
    tmp_path: Path, stall: Stall
) -> None:
    # A writer faster than a working output is slowed down, not refused (wrk saw 503s where the output
    # was only slower than 64 writers of batches).
    async with proxy_client(config(tmp_path, max_waiting_chunks=2, backlog_wait_s=60)) as client:
        for chunk in range(2):
            assert (await post(client, chunk, docs(3 * chunk, 3))).status_code == 200
        waiting = asyncio.create_task(post(client, 2, docs(6, 1)))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held while the output has not caught up
        assert not (tmp_path / "ckpt" / "00000" / "chunk_00002.jsonl").exists()
        stall.release()
        answer = await waiting
        assert (answer.status_code, answer.json()["written"]) == (200, 1)
        assert (await client.get("/resume")).json()["last_chunk_index"] == 1


async def test_past_max_waiting_chunks_a_failing_output_is_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_output(monkeypatch, times=1000)
    async with proxy_client(config(tmp_path, max_waiting_chunks=1, backlog_wait_s=3600)) as client:
        assert (await post(client, 0, docs(0, 3))).status_code == 200
        for _ in range(500):  # the publication's first failure
            view = next(r for r in (await client.get("/stats")).json()["ranks"] if r["rank"] == 0)
            if view["publication_error"]:
                break
            await asyncio.sleep(0.01)
        refused = await asyncio.wait_for(post(client, 1, docs(3, 1)), timeout=60)
        assert refused.status_code == 503
        assert "Permission denied" in refused.json()["error"]["message"]


def failing_output(monkeypatch: pytest.MonkeyPatch, times: int, code: int = errno.EACCES) -> list[int]:
    """The output refuses the next `times` publications (a bucket's 403, a read-only mount)."""
    calls: list[int] = []
    real = app.checkpoints.publish.atomic_write_bytes

    def refusing(path: str, data: bytes, **options: Any) -> None:
        calls.append(1)
        if len(calls) <= times:
            raise OSError(code, os.strerror(code), path)
        real(path, data, **options)

    monkeypatch.setattr(app.checkpoints.publish, "atomic_write_bytes", refusing)
    return calls


async def test_the_job_client_retries_resume_through_an_output_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = failing_output(monkeypatch, times=2)
    async with serve_proxy(config(tmp_path, publish_retry_max_s=60)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await post(client, 0, docs(0, 3))).status_code == 200
        job = ProxyJob(url, 0, unavailable_wait_s=60)
        try:
            resume = await job.resume()  # 503 with Retry-After while the output refuses, then the answer
        finally:
            await job.close()
    assert (resume.last_chunk_index, resume.docs_to_skip) == (0, 3)
    assert len(calls) >= 3


async def test_a_job_client_gives_up_on_a_long_outage_with_the_proxys_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_output(monkeypatch, times=1000)
    async with serve_proxy(config(tmp_path)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await post(client, 0, docs(0, 3))).status_code == 200
        job = ProxyJob(url, 0, unavailable_wait_s=0.5)
        try:
            with pytest.raises(Exception, match=r"503: .*cannot be published to the output.*Permission denied"):
                await job.resume()
        finally:
            await job.close()


async def test_a_failing_publication_is_retried_in_the_background_without_any_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = failing_output(monkeypatch, times=1)
    cm = manager(tmp_path / "ckpt", 2, publish_in_background=True, retry_backoff_s=0.05)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        for doc_id in ("a", "b"):
            await cm.write_document(document(doc_id), 0, 0, writer)
        # last_chunk is recorded inside the round, the failure cleared when the round ends
        for _ in range(500):
            if cm.last_chunk_index == 0 and cm.publication_failure is None:
                break
            await asyncio.sleep(0.01)
        assert cm.last_chunk_index == 0
        assert cm.publication_failure is None
        assert len(calls) == 2
        assert await cm.close()
    assert os.listdir(tmp_path / "out") == ["00000_chunk_0.jsonl"]


async def test_a_rank_waiting_for_a_failing_output_is_not_busy_and_closes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_output(monkeypatch, times=1000)
    cm = manager(tmp_path / "ckpt", 2, publish_in_background=True, retry_backoff_s=30)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        for doc_id in ("a", "b"):
            await cm.write_document(document(doc_id), 0, 0, writer)
        with pytest.raises(PublishError):
            await cm.publish_pending(0)
        assert cm.publication_failure is not None
        assert "Permission denied" in cm.publication_failure.reason
        assert cm.waiting_chunks() == [0]
        assert not cm.busy()  # the idle release may give the rank up: the chunk stays in its checkpoints
        assert await asyncio.wait_for(cm.close(grace_s=5), timeout=10)  # the 30 s backoff does not hold it
    assert (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").exists()


async def test_a_rank_closed_with_chunks_its_failing_output_did_not_take_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # SIGTERM exited 0 saying "every rank released", nothing about the chunk it left unpublished.
    failing_output(monkeypatch, times=1000)
    async with proxy_client(config(tmp_path)) as client:
        assert (await post(client, 0, docs(0, 3), rank=3)).status_code == 200
        for _ in range(500):
            view = next(r for r in (await client.get("/stats")).json()["ranks"] if r["rank"] == 3)
            if view["publication_error"]:
                break
            await asyncio.sleep(0.01)
        assert view["publication_error"]
    warnings = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "not published" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert warnings[0].startswith("rank 3 closed with complete chunks [0] not published (the output fails: publishing")
    assert "the rank's next owner publishes them" in warnings[0]
    assert (tmp_path / "ckpt" / "00003" / "chunk_00000.jsonl").exists()


async def test_a_publication_still_running_is_given_up_at_close_and_leaves_nothing(
    tmp_path: Path, stall: Stall
) -> None:
    cm = manager(tmp_path / "ckpt", 2, publish_in_background=True)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        for doc_id in ("a", "b"):
            await cm.write_document(document(doc_id), 0, 0, writer)
        await asyncio.to_thread(stall.started.wait, 10)
        assert cm.busy()
        assert await cm.close(grace_s=0.05)  # given up: nothing of it runs any more
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    assert cm.last_chunk_index == -1
    assert (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").exists()  # for the rank's next owner


async def test_a_full_chunk_beyond_max_waiting_chunks_raises_a_backlog_in_the_library(tmp_path: Path) -> None:
    cm = manager(tmp_path / "ckpt", 1, publish_in_background=True, max_waiting_chunks=1, backlog_wait_s=0.05)

    class Never(ChunkPublisher):
        async def close_file_async(self, original_name: str) -> None:
            await asyncio.Event().wait()

    writer = Never(str(tmp_path / "out"), str(tmp_path / "ckpt"))
    await cm.write_document(document("a"), 0, 0, writer)
    with pytest.raises(PublicationBacklog, match="max_waiting_chunks=1"):
        await cm.write_document(document("b"), 0, 1, writer)
    assert cm._publisher is not None
    cm._publisher.cancel()


def test_two_writers_of_one_file_never_share_a_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    renamed: list[str] = []
    real = os.replace

    def replacing(src: str, dst: str) -> None:
        renamed.append(os.path.basename(src))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replacing)
    target = str(tmp_path / "00000_chunk_0.jsonl")
    atomic_write_bytes(target, b"one\n")
    atomic_write_bytes(target, b"two\n")
    assert len(set(renamed)) == 2
    assert all(temporary_target(name) == "00000_chunk_0.jsonl" for name in renamed)
    assert os.listdir(tmp_path) == ["00000_chunk_0.jsonl"]


def test_a_write_whose_check_refuses_leaves_the_target_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "chunk.jsonl"
    target.write_bytes(b"published\n")

    def refuse() -> None:
        raise PublicationAbandoned("no longer the rank's owner")

    with pytest.raises(PublicationAbandoned):
        atomic_write_bytes(str(target), b"x" * (3 << 20), check=refuse)
    assert target.read_bytes() == b"published\n"
    assert os.listdir(tmp_path) == ["chunk.jsonl"]


async def test_a_publisher_that_no_longer_owns_the_rank_replaces_nothing(tmp_path: Path) -> None:
    owned = {0}
    cm = manager(tmp_path / "ckpt", 2)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt"), holds_rank=owned.__contains__) as writer:
        await cm.write_document(document("a"), 0, 0, writer)
        owned.clear()  # the rank was handed to another proxy
        with pytest.raises(PublicationAbandoned, match="no longer owns rank 0"):
            await cm.write_document(document("b"), 0, 0, writer)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_temporary_names_are_told_from_published_ones() -> None:
    assert temporary_target(".00000_chunk_3.jsonl.0123456789ab.tmp") == "00000_chunk_3.jsonl"
    assert temporary_target(".00000_chunk_3.jsonl.tmp") == "00000_chunk_3.jsonl"  # as 0.1 named it
    assert temporary_target("00000_chunk_3.jsonl") is None
    assert temporary_target(".hidden") is None


async def test_chunks_missing_from_the_output_are_refused_loudly_not_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with proxy_client(config(tmp_path)) as client:
        for chunk in range(3):
            assert (await post(client, chunk, docs(3 * chunk, 3))).status_code == 200
        assert (await client.get("/resume")).json()["last_chunk_index"] == 2
    # The output loses what was published (a bucket emptied, files pruned) while nobody runs.
    for chunk in (0, 2):
        (tmp_path / "out" / f"00000_chunk_{chunk}.jsonl").unlink()
    async with proxy_client(config(tmp_path)) as client:
        refused = await client.get("/resume")
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert error["type"] == "output_lost_error"
        assert "chunks [0, 2]" in error["message"]
        assert str(tmp_path / "out") in error["message"]
        assert "write -1 into" in error["message"]
        view = next(r for r in (await client.get("/stats")).json()["ranks"] if r["rank"] == 0)
        assert view["chunks_lost"] == [0, 2]
        assert 'inferproxy_chunks_lost{rank="0"} 2.0' in (await client.get("/metrics")).text
        assert (await post(client, 3, docs(9, 1))).status_code == 409  # no write goes on past the hole
    assert any("are not in the output" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)


async def test_a_chunk_published_as_nothing_is_not_taken_for_a_lost_one(tmp_path: Path) -> None:
    removed = {"__no_rollouts_remove": True}
    async with proxy_client(config(tmp_path, records_per_chunk=1)) as client:
        assert (await post(client, 0, {"id": "gone", "text": "t", "metadata": removed})).status_code == 200
        assert (await post(client, 1, docs(0, 1))).status_code == 200
        assert (await client.get("/resume")).json()["last_chunk_index"] == 1
    assert os.listdir(tmp_path / "out") == ["00000_chunk_1.jsonl"]
    async with proxy_client(config(tmp_path, records_per_chunk=1)) as client:
        resume = await client.get("/resume")
        assert (resume.status_code, resume.json()["last_chunk_index"]) == (200, 1)


async def test_a_restore_removes_the_temporary_files_a_killed_publication_left(tmp_path: Path) -> None:
    async with proxy_client(config(tmp_path)) as client:
        assert (await post(client, 0, docs(0, 2))).status_code == 200
    (tmp_path / "out").mkdir()
    left = [".00000_chunk_0.jsonl.tmp", ".00000_chunk_0.jsonl.0123456789ab.tmp"]
    for name in [*left, ".00001_chunk_0.jsonl.0123456789ab.tmp", "notes.txt"]:
        (tmp_path / "out" / name).write_bytes(b"partial")
    async with proxy_client(config(tmp_path)) as client:
        assert (await client.get("/resume")).status_code == 200
    # Rank 0's are gone; another rank's (its own owner's business) and other files are left alone.
    assert sorted(os.listdir(tmp_path / "out")) == [".00001_chunk_0.jsonl.0123456789ab.tmp", "notes.txt"]


async def test_a_resume_of_an_open_rank_refuses_chunks_the_output_lost_meanwhile(tmp_path: Path) -> None:
    async with proxy_client(config(tmp_path)) as client:
        for chunk in range(2):
            assert (await post(client, chunk, docs(3 * chunk, 3))).status_code == 200
        assert (await client.get("/resume")).json()["last_chunk_index"] == 1
        # Pruned while the proxy still has the rank open (a job restarted within rank_idle_s).
        (tmp_path / "out" / "00000_chunk_0.jsonl").unlink()
        refused = await client.get("/resume")
        assert refused.status_code == 409
        assert refused.json()["error"]["type"] == "output_lost_error"
        assert "chunks [0]" in refused.json()["error"]["message"]
        assert (await post(client, 2, docs(6, 1))).status_code == 409  # no write goes on past the hole
        # The way out the message gives, with the proxy still running: what it says is read again.
        (tmp_path / "ckpt" / "last_chunk" / "00000.txt").write_text("-1")
        resume = (await client.get("/resume")).json()
        assert (resume["last_chunk_index"], resume["docs_to_skip"]) == (-1, 0)
        for chunk in range(2):
            assert (await post(client, chunk, docs(3 * chunk, 3))).status_code == 200
        assert (await client.get("/resume")).json()["last_chunk_index"] == 1
    assert sorted(os.listdir(tmp_path / "out")) == ["00000_chunk_0.jsonl", "00000_chunk_1.jsonl"]


async def test_a_storm_of_resumes_during_an_outage_is_not_a_storm_of_uploads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = failing_output(monkeypatch, times=1000)
    cm = manager(tmp_path / "ckpt", 2, publish_in_background=True, retry_backoff_s=30)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        for doc_id in ("a", "b"):
            await cm.write_document(document(doc_id), 0, 0, writer)
        for _ in range(50):  # GET /resume or POST /chunks/{i}/complete, again and again
            with pytest.raises(PublishError, match="Permission denied"):
                await cm.publish_pending(0)
        # The background's first attempt and at most one asked for: the rest get the last attempt's error.
        assert len(calls) <= 2
        failure = cm.publication_failure
        assert failure is not None
        assert len(list(traceback.walk_tb(failure.error.__traceback__))) < 20  # not one frame per refusal
        assert await cm.close(grace_s=5)


async def test_a_huge_hostile_output_error_is_shown_cut_and_harmless(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a misbehaving object store or gateway may answer: markup, escape sequences, a megabyte of it.
    hostile = "\x1b[2J\x1b]0;owned\x07<script>alert(1)</script>\r\nforged line " + "x" * 1_000_000

    def refusing(path: str, data: bytes, **options: Any) -> None:
        raise OSError(errno.EIO, hostile)

    monkeypatch.setattr(app.checkpoints.publish, "atomic_write_bytes", refusing)
    async with proxy_client(config(tmp_path)) as client:
        assert (await post(client, 0, docs(0, 3))).status_code == 200
        refused = await client.get("/resume")
        assert refused.status_code == 503
        assert len(refused.json()["error"]["message"]) < 4000
        assert "characters more" in refused.json()["error"]["message"]
        stats = (await client.get("/stats")).json()
        error = next(r for r in stats["ranks"] if r["rank"] == 0)["publication_error"]
        assert error.startswith("publishing 00000_chunk_0.jsonl failed: [Errno 5] \x1b[2J")  # what was there
        assert len(error) < 2000
        lines = render(stats, "http://proxy")
        assert not any("\x1b" in line or "\r" in line or "\x07" in line for line in lines)
        assert sum("forged line" in line for line in lines) == 1  # on the rank's own line, not a line of its own
        assert max(len(line) for line in lines) < 2000


async def test_a_stalled_output_listing_never_keeps_a_stopping_proxy_from_exiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hard NFS mount gone quiet, an endpoint that never answers: the look at the output hangs for good.
    # asyncio joins its own worker threads when the loop closes (and the interpreter at exit): SIGTERM hung.
    hung: list[threading.Thread] = []
    forever = threading.Event()

    def stalled(publisher: ChunkPublisher, *args: Any) -> Any:
        hung.append(threading.current_thread())
        forever.wait()

    for look in ("missing_chunks", "last_published_chunk", "remove_stale_temporaries"):
        monkeypatch.setattr(ChunkPublisher, look, stalled)
    (tmp_path / "ckpt" / "00001").mkdir(parents=True)
    (tmp_path / "ckpt" / "00001" / "chunk_00000.jsonl").write_bytes(b'{"id": "a", "text": "t"}\n')
    (tmp_path / "ckpt" / "last_chunk").mkdir()
    (tmp_path / "ckpt" / "last_chunk" / "00002.txt").write_text("0")
    try:
        async with proxy_client(config(tmp_path, shutdown_grace_s=0.1)) as client:
            for rank in (0, 1, 2):  # a new rank (its output looked up), one restored, one checked
                with pytest.raises(httpx.TimeoutException):
                    await client.get("/resume", headers={"X-Rank": str(rank)}, timeout=0.5)
        assert hung
        assert all(thread.daemon for thread in hung)
    finally:
        forever.set()


async def test_a_full_checkpoints_disk_refusing_a_chunk_published_as_nothing_names_that_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = app.checkpoints.publish.atomic_write_bytes

    def full_checkpoints_disk(path: str, data: bytes, **options: Any) -> None:
        if path.startswith(str(tmp_path / "ckpt")):  # empty_chunks/<rank>.txt: the output is fine
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(path, data, **options)

    monkeypatch.setattr(app.checkpoints.publish, "atomic_write_bytes", full_checkpoints_disk)
    removed = {"__no_rollouts_remove": True}
    async with proxy_client(config(tmp_path, records_per_chunk=1)) as client:
        assert (await post(client, 0, {"id": "gone", "text": "t", "metadata": removed})).status_code == 200
        refused = await client.get("/resume")
        assert refused.status_code == 503
        message = refused.json()["error"]["message"]
        assert f"recorded in the checkpoints dir {tmp_path / 'ckpt'} (its disk is full" in message
        assert "the output" not in message.split(":")[0]  # the output is not what to free space on


async def test_a_complete_chunk_whose_checkpoint_file_is_gone_is_forgotten_so_a_restarted_job_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_output(monkeypatch, times=1)
    cm = manager(tmp_path / "ckpt", 2, retry_backoff_s=0)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        await cm.write_document(document("a"), 0, 0, writer)
        with pytest.raises(PublishError, match="Permission denied"):
            await cm.write_document(document("b"), 0, 0, writer)
        (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").unlink()  # removed under the running proxy
        with pytest.raises(PublishError, match="is gone"):
            await cm.publish_pending(0)
        # What a restarted proxy would find: no such chunk. The job generates its documents again,
        # rather than meet the same 500 at every resume for as long as this proxy keeps the rank open.
        await cm.publish_pending(0)
        assert cm.resume_state() == (0, [])
        assert (cm.waiting_chunks(), cm.publication_failure) == ([], None)
        for doc_id in ("a", "b"):
            assert (await cm.write_document(document(doc_id), 0, 0, writer)).written
        assert cm.last_chunk_index == 0
    assert os.listdir(tmp_path / "out") == ["00000_chunk_0.jsonl"]

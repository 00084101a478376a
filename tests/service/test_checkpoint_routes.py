"""The checkpoint service in-process (contract §5): statuses, durability, publication, recovery."""

from __future__ import annotations

import asyncio
import errno
import gzip
import json
import logging
import os
import shutil
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import app.checkpoints.chunkfiles
import app.checkpoints.manager
import app.checkpoints.publish
import app.checkpoints.resume
import app.service.services
import app.store.cache
import app.store.durable
from app.checkpoints.publish import ChunkPublisher
from app.service.routes.checkpoints import public_output
from app.service.settings import Settings
from tests import faults
from tests.factories import completion_request, last_chunk_path, write_chunk_file
from tests.servers import fake_upstream, proxy_client

# Under both servers: the app must behave the same under the built-in one and under uvicorn.
pytestmark = pytest.mark.usefixtures("http_server")


def config(tmp_path: Path, upstream: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "upstream": [upstream],
        "checkpoints_dir": tmp_path / "ckpt",
        "output": str(tmp_path / "out"),
        "records_per_chunk": 3,
    }
    return Settings(**{**values, **overrides})


def doc(doc_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": doc_id, "text": f"text of {doc_id}", **extra}


async def post(c: httpx.AsyncClient, body: Any, chunk: int | None = 0, rank: int = 0) -> httpx.Response:
    headers = {"X-Rank": str(rank)}
    if chunk is not None:
        headers["X-Chunk-Index"] = str(chunk)
    return await c.post("/documents", json=body, headers=headers)


def published(tmp_path: Path) -> dict[str, list[str]]:
    out = tmp_path / "out"
    if not out.exists():
        return {}
    return {
        f.name: [json.loads(line)["id"] for line in f.read_text().splitlines()]
        for f in sorted(out.iterdir())
        if not f.name.startswith(".")
    }


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as c:
        yield c


async def test_documents_are_acknowledged_and_a_full_chunk_is_published(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    first = await post(client, doc("a"))
    assert first.status_code == 200
    assert first.json() == {
        "rank": 0,
        "chunk_index": 0,
        "written": 1,
        "duplicates": 0,
        "chunk_count": 1,
        "chunk_complete": False,
        "last_chunk_index": -1,
    }
    rest = await post(client, [doc("b"), doc("c")])
    assert rest.json()["chunk_complete"] is True
    assert rest.json()["last_chunk_index"] in (-1, 0)  # published beside the rank's writes, maybe not yet
    assert (await client.get("/resume")).json()["last_chunk_index"] == 0  # once what is waiting is published
    assert published(tmp_path) == {"00000_chunk_0.jsonl": ["a", "b", "c"]}
    assert not (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").exists()


async def test_resume_counts_a_write_received_but_not_yet_durable_once_it_is(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job killed just after sending documents and started again at once asks for its resume point while
    the proxy is still writing them: the answer waits for that write, so it neither skips documents not yet
    on disk nor misses them (the restarted job would pay for them again)."""
    assert (await post(client, doc("a"))).status_code == 200  # the rank open
    real = app.checkpoints.chunkfiles.ChunkFiles.make_durable
    syncing, durable = asyncio.Event(), asyncio.Event()

    async def slow(self: Any, file: Any) -> None:
        syncing.set()
        await durable.wait()  # the fsync, as slow as the test wants
        await real(self, file)

    monkeypatch.setattr(app.checkpoints.chunkfiles.ChunkFiles, "make_durable", slow)
    write = asyncio.create_task(post(client, doc("b")))  # the killed job's last write
    await syncing.wait()
    resume = asyncio.create_task(client.get("/resume"))  # the restarted job's first question
    await asyncio.sleep(0.2)  # time enough to answer it, were it not waiting (a wait, not a barrier)
    assert not resume.done(), "answered while the write it counts was not on disk"
    durable.set()
    assert (await write).status_code == 200
    assert (await resume).json()["processed_ids"] == ["a", "b"]


async def test_a_rank_whose_write_waits_for_its_fsync_is_not_released_as_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write waiting for its fsync holds no lock of the rank's: an idle-release round then closed the
    rank's files under it (under CI's load the fsync outlasted `rank_idle_s`)."""
    real = app.checkpoints.chunkfiles.ChunkFiles.make_durable
    syncing, durable = asyncio.Event(), asyncio.Event()

    async def slow(self: Any, file: Any) -> None:
        syncing.set()
        await durable.wait()
        await real(self, file)

    monkeypatch.setattr(app.checkpoints.chunkfiles.ChunkFiles, "make_durable", slow)
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url, rank_idle_s=0.05)) as c:
        write = asyncio.create_task(post(c, doc("a")))
        await syncing.wait()
        await asyncio.sleep(0.5)  # many release rounds, every rank_idle_s / 4 (a wait, not a barrier)
        assert (await c.get("/stats")).json()["owned_ranks"] == [0]
        durable.set()
        assert (await write).status_code == 200
        assert (await c.get("/resume")).json()["processed_ids"] == ["a"]


async def test_a_retried_post_counts_duplicates_and_writes_nothing_twice(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    await post(client, [doc("a"), doc("b")])
    again = await post(client, [doc("a"), doc("b")])
    assert (again.json()["written"], again.json()["duplicates"], again.json()["chunk_count"]) == (0, 2, 2)
    lines = (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": "no id"}, "id must be a non-empty string"),
        ([doc("ok"), {"id": "x", "text": 5}], "document 1 ('x'): text must be a string"),
        ({"id": "x", "text": "t", "extra": 1}, "unknown fields ['extra']"),
        ({"id": "x", "text": "t", "metadata": []}, "metadata must be an object"),
        ([], "empty"),
        ("just a string", "must be a JSON object"),
    ],
)
async def test_malformed_documents_get_400_and_nothing_is_written(
    client: httpx.AsyncClient, tmp_path: Path, body: Any, message: str
) -> None:
    answer = await post(client, body)
    assert answer.status_code == 400
    assert message in answer.json()["error"]["message"]
    assert not (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").exists()


@pytest.mark.parametrize("number", ["123456789012345678901234567890", "-9223372036854775809", "18446744073709551616"])
async def test_a_document_holding_an_integer_past_64_bits_gets_400_and_nothing_is_written(
    client: httpx.AsyncClient, tmp_path: Path, number: str
) -> None:
    # orjson read it as a float: the document was acknowledged and written changed (1.2345678901234568e+29),
    # where datatrove's writer refuses such a value (an attack run).
    body = b'{"id": "a", "text": "x", "metadata": {"user_id": ' + number.encode() + b"}}"
    answer = await client.post("/documents", content=body, headers={"X-Rank": "0", "X-Chunk-Index": "0"})
    assert answer.status_code == 400, answer.text
    assert "past 64 bits" in answer.json()["error"]["message"]
    assert not (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").exists()


async def test_a_documents_64_bit_integers_are_written_exactly(client: httpx.AsyncClient, tmp_path: Path) -> None:
    body = b'{"id": "a", "text": "x", "metadata": {"u": 18446744073709551615, "i": -9223372036854775808}}'
    answer = await client.post("/documents", content=body, headers={"X-Rank": "0", "X-Chunk-Index": "0"})
    assert answer.status_code == 200, answer.text
    line = (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").read_text()
    assert json.loads(line)["metadata"] == {"u": 2**64 - 1, "i": -(2**63)}


async def test_a_last_chunk_before_chunks_holding_documents_is_refused_and_deletes_none(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    # Completing chunk 1 as the rank's last removed the rank's folder, chunk 2's acknowledged document with
    # it, and nothing said so (an attack run).
    assert (await post(client, [doc("a"), doc("b"), doc("c")], chunk=0)).status_code == 200
    assert (await post(client, doc("late"), chunk=2)).status_code == 200
    refused = await client.post("/chunks/1/complete", headers={"X-Rank": "0"})
    assert refused.status_code == 409
    assert refused.json()["error"]["message"] == (
        "chunk 1 cannot be the rank's last: chunks after it (2) hold documents, which completing it would "
        "delete; complete the last chunk written to (2), nothing was changed"
    )
    chunk_2 = tmp_path / "ckpt" / "00000" / "chunk_00002.jsonl"
    assert [json.loads(line)["id"] for line in chunk_2.read_text().splitlines()] == ["late"]
    assert (await client.post("/chunks/2/complete", headers={"X-Rank": "0"})).status_code == 200
    assert published(tmp_path)["00000_chunk_2.jsonl"] == ["late"]


async def test_concurrent_writes_filling_a_chunk_each_say_its_count_and_completeness_together(
    client: httpx.AsyncClient,
) -> None:
    # The count was read as the write appended, whether the chunk was complete after its fsync, which the
    # other writes shared: three writes filling a chunk of 3 each said "complete", one with a count of 1.
    for round_ in range(5):
        answers = await asyncio.gather(*(post(client, doc(f"{round_}-{i}"), chunk=round_) for i in range(3)))
        seen = sorted((a.json()["chunk_count"], a.json()["chunk_complete"]) for a in answers)
        assert seen == [(1, False), (2, False), (3, True)]


async def test_missing_or_bad_headers_get_400(client: httpx.AsyncClient) -> None:
    assert (await post(client, doc("a"), chunk=None)).json()["error"]["param"] == "X-Chunk-Index"
    assert (await post(client, doc("a"), rank=100_000)).json()["error"]["param"] == "X-Rank"


async def test_a_complete_chunk_gets_409_and_an_overfull_batch_too(client: httpx.AsyncClient) -> None:
    await post(client, [doc("a"), doc("b"), doc("c")])
    late = await post(client, doc("d"))
    assert late.status_code == 409
    assert "chunk 0 is already complete" in late.json()["error"]["message"]
    overfull = await post(client, [doc("e"), doc("f"), doc("g"), doc("h")], chunk=1)
    assert overfull.status_code == 409
    assert "room for 3 more documents" in overfull.json()["error"]["message"]


async def test_a_body_over_max_body_bytes_gets_413(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url, max_body_bytes=100)) as c:
        answer = await post(c, doc("a", metadata={"big": "x" * 200}))
        assert answer.status_code == 413


async def test_disk_full_gets_507_writes_nothing_and_the_next_write_succeeds(
    client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await post(client, doc("a"))
    real_write = os.write

    def enospc(fd: int, data: Any) -> int:
        real_write(fd, bytes(data[:5]))  # a torn start of the batch, as a full disk may leave it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(app.store.durable.os, "write", enospc)
    full = await post(client, [doc("b"), doc("c")])
    assert full.status_code == 507
    assert "nothing of this request was written" in full.json()["error"]["message"]
    monkeypatch.undo()
    lines = (tmp_path / "ckpt" / "00000" / "chunk_00000.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a"]
    assert (await client.get("/healthz")).status_code == 200
    assert (await post(client, [doc("b"), doc("c")])).json()["written"] == 2


def disk_full(path: str, *args: Any, **options: Any) -> None:
    """`atomic_write_bytes` (or any other write of `path`: `make_dirs_durable`, ...) on a full disk."""
    raise OSError(errno.ENOSPC, "No space left on device", path)


async def test_a_full_output_disk_keeps_acknowledging_documents_resume_says_503_and_it_publishes_once_space_returns(
    client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app.checkpoints.publish, "atomic_write_bytes", disk_full)
    answer = await post(client, [doc("a"), doc("b"), doc("c")])
    assert (answer.status_code, answer.json()["written"], answer.json()["chunk_complete"]) == (200, 3, True)
    assert (await post(client, doc("d"), chunk=1)).status_code == 200  # the next chunk goes on meanwhile
    resume = await client.get("/resume")
    assert resume.status_code == 503
    assert resume.json()["error"]["type"] == "output_unavailable"
    assert int(resume.headers["retry-after"]) >= 1
    message = resume.json()["error"]["message"]
    assert f"the output {tmp_path / 'out'}" in message
    assert "disk is full" in message
    assert "No space left on device" in message
    assert published(tmp_path) == {}
    monkeypatch.undo()
    await asyncio.sleep(1)  # as a job client waits Retry-After: a /resume sooner gets the last attempt's error
    assert (await client.get("/resume")).json()["last_chunk_index"] == 0  # then retried at once by /resume
    assert published(tmp_path) == {"00000_chunk_0.jsonl": ["a", "b", "c"]}


async def test_a_full_checkpoints_disk_refusing_last_chunk_is_503_naming_it_and_a_retry_records_it(
    client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app.checkpoints.manager, "atomic_write_bytes", disk_full)
    answer = await post(client, [doc("a"), doc("b"), doc("c")])
    assert (answer.status_code, answer.json()["written"]) == (200, 3)  # the documents are durable
    resume = await client.get("/resume")
    message = resume.json()["error"]["message"]
    assert resume.status_code == 503
    assert "retry-after" in resume.headers
    assert f"recorded in the checkpoints dir {tmp_path / 'ckpt'} (its disk is full" in message
    monkeypatch.undo()
    await asyncio.sleep(1)  # the Retry-After a job client waits
    resume = await client.get("/resume")
    assert (resume.status_code, resume.json()["last_chunk_index"]) == (200, 0)
    assert (tmp_path / "ckpt" / "last_chunk" / "00000.txt").read_text() == "0"


def opening_refused(answer: httpx.Response, tmp_path: Path, reason: str) -> None:
    """`answer` is the 507 of a rank that a full checkpoints disk kept from opening."""
    assert answer.status_code == 507
    assert answer.json()["error"] == {
        "message": f"rank 0 cannot be opened: the checkpoints disk is full ({reason}), and nothing of this "
        f"request was written; free space under {tmp_path / 'ckpt'}, then send it again",
        "type": "insufficient_storage",
        "param": None,
        "code": 507,
    }


@pytest.mark.parametrize("route", ["documents", "v1"])
@pytest.mark.parametrize("refused", ["rank folder", "cache file"])
async def test_a_full_disk_refusing_a_rank_s_request_cache_gets_507_and_leaves_the_rank_free(
    client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str, route: str
) -> None:
    # Was a 500: the OSError of the rank's folder, or SQLite's "database or disk is full".
    real_migrations = app.store.cache.apply_migrations

    def full_file(conn: sqlite3.Connection) -> list[str]:
        conn.execute("PRAGMA max_page_count = 1")  # SQLite refuses to grow the file, as on a full disk
        return real_migrations(conn)

    if refused == "rank folder":
        monkeypatch.setattr(app.store.cache, "make_dirs_durable", disk_full)
    else:
        monkeypatch.setattr(app.store.cache, "apply_migrations", full_file)

    async def send() -> httpx.Response:
        if route == "documents":
            return await post(client, doc("a"))
        return await client.post("/v1/completions", json=completion_request(), headers={"X-Doc-Id": "a"})

    answer = await send()
    monkeypatch.undo()
    opening_refused(
        answer, tmp_path, "No space left on device" if refused == "rank folder" else "database or disk is full"
    )
    assert (await client.get("/stats")).json()["owned_ranks"] == []
    assert (await send()).status_code == 200


@pytest.mark.parametrize("refused", ["last_chunk", "checkpoint_meta.json"])
async def test_a_full_disk_refusing_the_recovery_of_a_rank_from_the_output_gets_507_and_a_retry_recovers_it(
    client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    # Was a 500. Checkpoints lost, chunk 0 published: the recovery records both in the checkpoints dir.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "00000_chunk_0.jsonl").write_text(json.dumps({"id": "d0", "text": "t"}) + "\n")
    if refused == "last_chunk":
        monkeypatch.setattr(app.service.services, "atomic_write_bytes", disk_full)
    else:
        monkeypatch.setattr(app.checkpoints.resume, "create_exclusive_bytes", disk_full)
    answer = await client.get("/resume")
    monkeypatch.undo()
    opening_refused(answer, tmp_path, "No space left on device")
    again = await client.get("/resume")
    assert (again.status_code, again.json()["last_chunk_index"]) == (200, 0)


async def test_a_full_disk_refusing_to_drop_the_last_chunk_s_cache_rows_on_restore_gets_507_and_a_retry_restores(
    client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was a 500 (CacheWriteError): a restore drops the rows of the last chunk, which a crash may have left.
    Path(last_chunk_path(tmp_path / "ckpt")).parent.mkdir(parents=True)
    Path(last_chunk_path(tmp_path / "ckpt")).write_text("0")
    write_chunk_file(tmp_path / "ckpt", 1, ["d3"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "00000_chunk_0.jsonl").write_text("{}\n")  # what last_chunk says was published

    def full(*_: Any) -> Any:
        raise faults.sqlite_full()

    monkeypatch.setattr(app.store.cache, "_write_batch", full)
    answer = await client.get("/resume")
    monkeypatch.undo()
    opening_refused(answer, tmp_path, "database or disk is full")
    again = (await client.get("/resume")).json()
    assert (again["last_chunk_index"], again["processed_ids"]) == (0, ["d3"])


@pytest.mark.parametrize("route", ["complete"])  # a write's chunk is published in the background
@pytest.mark.parametrize(
    ("refusal", "status"), [(faults.sqlite_full, 507), (faults.sqlite_read_only, 500)], ids=["full", "read-only"]
)
async def test_a_chunk_published_whose_cache_rows_a_full_disk_keeps_gets_507_saying_what_is_done(
    client: httpx.AsyncClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    refusal: Callable[[], sqlite3.Error],
    status: int,
    route: str,
) -> None:
    # Was a 500 (CacheWriteError) for either, after the chunk was published and recorded in last_chunk.
    def refused(*_: Any) -> Any:
        raise refusal()

    if route == "complete":
        assert (await post(client, doc("a"))).status_code == 200
    monkeypatch.setattr(app.store.cache, "_write_batch", refused)
    if route == "documents":
        answer = await post(client, [doc("a"), doc("b"), doc("c")])
    else:
        answer = await client.post("/chunks/0/complete", headers={"X-Rank": "0"})
    monkeypatch.undo()
    assert answer.status_code == status
    message = answer.json()["error"]["message"]
    if status == 500:
        assert "CacheWriteError: could not commit 0 cache entries" in message  # as before
    elif route == "documents":
        assert message == (
            f"the documents are stored, but the request cache could not be updated after a chunk was published "
            f"(nothing needs to be sent again): the checkpoints disk is full (database or disk is full), free "
            f"space under {tmp_path / 'ckpt'}"
        )
    else:
        assert message == (
            f"chunk 0 is marked complete, but the request cache could not be updated after a chunk was published "
            f"(send this request again to finish): the checkpoints disk is full (database or disk is full), free "
            f"space under {tmp_path / 'ckpt'}"
        )
    assert published(tmp_path) == {"00000_chunk_0.jsonl": ["a", "b", "c"] if route == "documents" else ["a"]}
    assert Path(last_chunk_path(tmp_path / "ckpt")).read_text() == "0"
    if route == "documents":
        assert (await post(client, doc("d"), chunk=1)).json()["written"] == 1
    else:
        assert (await client.post("/chunks/0/complete", headers={"X-Rank": "0"})).status_code == 200
        assert not (tmp_path / "ckpt" / "00000").exists()


@pytest.mark.parametrize("full", ["ckpt", "out"])
async def test_a_full_disk_refusing_to_publish_a_chunk_a_restore_found_complete_gets_503_and_a_retry_publishes_it(
    client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: str
) -> None:
    # Was a 500 (PublishError): a proxy killed after a chunk's last document, before its publication.
    write_chunk_file(tmp_path / "ckpt", 0, ["a", "b", "c"])
    monkeypatch.setattr(
        app.checkpoints.manager if full == "ckpt" else app.checkpoints.publish, "atomic_write_bytes", disk_full
    )
    answer = await client.get("/resume")
    monkeypatch.undo()
    message = answer.json()["error"]["message"]
    assert answer.status_code == 503
    assert int(answer.headers["retry-after"]) >= 1
    where = "recorded in the checkpoints dir" if full == "ckpt" else "published to the output"
    assert message.startswith(f"rank 0's complete chunks cannot be {where} {tmp_path / full} (its disk is full")
    assert message.endswith(
        "They stay checkpointed and are retried in the background; this answer is given once "
        "they are (the job client retries it)"
    )
    await asyncio.sleep(1)  # the Retry-After a job client waits
    again = (await client.get("/resume")).json()
    assert (again["last_chunk_index"], again["processed_ids"]) == (0, [])
    assert published(tmp_path) == {"00000_chunk_0.jsonl": ["a", "b", "c"]}


async def test_after_a_failed_fsync_the_rank_refuses_writes_until_the_proxy_restarts_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    async with fake_upstream() as (url, _):
        async with proxy_client(config(tmp_path, url)) as c:
            assert (await post(c, doc("a"))).status_code == 200
            monkeypatch.setattr(os, "fsync", eio)
            assert (await post(c, doc("b"))).status_code == 500
            monkeypatch.undo()
            refused = await post(c, doc("c"))  # the kernel may have dropped what it could not write
            assert refused.status_code == 500
            assert "restart inferproxy serve, then the job" in refused.json()["error"]["message"]
            resume = await c.get("/resume")  # it cannot say what is on disk either (it said "failed on this request")
            assert resume.status_code == 500
            assert resume.json()["error"]["message"] == refused.json()["error"]["message"]
        async with proxy_client(config(tmp_path, url)) as c:
            assert (await post(c, doc("c"))).status_code == 200


async def test_completing_the_last_chunk_publishes_it_and_removes_the_working_files(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Doc-Id": "a"})  # opens the cache
    await post(client, [doc("a"), doc("b"), doc("c")])
    await post(client, [doc("d")], chunk=1)
    done = await client.post("/chunks/1/complete", headers={"X-Rank": "0"})
    assert done.json() == {"rank": 0, "last_chunk_index": 1, "pending": []}
    assert published(tmp_path) == {"00000_chunk_0.jsonl": ["a", "b", "c"], "00000_chunk_1.jsonl": ["d"]}
    assert not (tmp_path / "ckpt" / "00000").exists()
    assert (tmp_path / "ckpt" / "last_chunk" / "00000.txt").read_text() == "1"
    resume = await client.get("/resume")
    assert resume.json() == {
        "rank": 0,
        "records_per_chunk": 3,
        "last_chunk_index": 1,
        "docs_to_skip": 6,
        "processed_ids": [],
        "output": str(tmp_path / "out"),
        "output_filename": "${rank}_chunk_${chunk_index}.jsonl",
    }


async def test_a_chunk_completed_ahead_of_an_open_one_waits(client: httpx.AsyncClient) -> None:
    await post(client, [doc("a")], chunk=0)
    done = await client.post("/chunks/1/complete")
    assert done.json() == {"rank": 0, "last_chunk_index": -1, "pending": [1]}


async def test_removed_documents_are_counted_but_not_published_and_an_empty_chunk_publishes_nothing(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    gone = {"__no_rollouts_remove": True}
    await post(client, [doc("a", metadata=gone), doc("b"), doc("c", metadata=gone)])
    await post(client, [doc("d", metadata=gone), doc("e", metadata=gone), doc("f", metadata=gone)], chunk=1)
    assert (await client.get("/resume")).json()["last_chunk_index"] == 1  # answered once both are published
    assert published(tmp_path) == {"00000_chunk_0.jsonl": ["b"]}


async def test_resume_reports_what_datatrove_would(client: httpx.AsyncClient) -> None:
    await post(client, [doc("a"), doc("b"), doc("c")], chunk=0)
    await post(client, [doc("e")], chunk=1)
    await post(client, [doc("h"), doc("i")], chunk=2)
    resume = (await client.get("/resume")).json()
    assert (resume["docs_to_skip"], resume["processed_ids"]) == (3, ["e", "h", "i"])


async def test_a_restarted_proxy_answers_resume_as_the_one_that_stopped(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _):
        async with proxy_client(config(tmp_path, url)) as c:
            for rank in (0, 4):
                await post(c, [doc(f"{rank}-a"), doc(f"{rank}-b"), doc(f"{rank}-c")], rank=rank)
                await post(c, [doc(f"{rank}-d")], chunk=1, rank=rank)
            before = [(await c.get("/resume", headers={"X-Rank": str(r)})).json() for r in (0, 4)]
        async with proxy_client(config(tmp_path, url)) as c:
            after = [(await c.get("/resume", headers={"X-Rank": str(r)})).json() for r in (0, 4)]
            assert (await c.get("/stats")).json()["owned_ranks"] == [0, 4]  # restored on their first request
        assert after == before
        assert before[1]["processed_ids"] == ["4-d"]


async def test_a_restart_with_another_records_per_chunk_is_refused_naming_both(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _):
        async with proxy_client(config(tmp_path, url)) as c:
            await post(c, doc("a"))
        with pytest.raises(ValueError, match=r"records_per_chunk=3.*records_per_chunk=5"):
            async with proxy_client(config(tmp_path, url, records_per_chunk=5)):
                pass


async def test_compressed_output_names_compress(tmp_path: Path) -> None:
    settings = config(tmp_path, "http://127.0.0.1:9", output_filename="${rank}/part_${chunk_index}.jsonl.gz")
    async with proxy_client(settings) as c:
        await post(c, [doc("a"), doc("b"), doc("c")])
    text = gzip.decompress((tmp_path / "out" / "00000" / "part_0.jsonl.gz").read_bytes()).decode()
    assert [json.loads(line)["id"] for line in text.splitlines()] == ["a", "b", "c"]


async def test_output_to_an_fsspec_url_is_uploaded_in_one_piece(tmp_path: Path) -> None:
    import fsspec

    settings = config(tmp_path, "http://127.0.0.1:9", output="memory://bucket/run-1")
    async with proxy_client(settings) as c:
        await post(c, [doc("a"), doc("b"), doc("c")])
    fs = fsspec.filesystem("memory")
    lines = fs.cat_file("/bucket/run-1/00000_chunk_0.jsonl").decode().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a", "b", "c"]


@pytest.mark.parametrize("name", ["${id}.jsonl", "chunk_${chunk_index}.jsonl", "${rank}_${chunk_index}_${id}"])
def test_an_output_filename_needs_rank_and_chunk_index_and_nothing_else(name: str) -> None:
    with pytest.raises(ValueError, match=r"must use \$\{rank\} and \$\{chunk_index\} and nothing else"):
        Settings(output_filename=name)


async def test_completing_a_chunk_while_a_document_for_it_is_in_flight_loses_nothing(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    import asyncio

    await post(client, [doc("a")], chunk=0)
    late, done = await asyncio.gather(post(client, [doc("late")], chunk=0), client.post("/chunks/0/complete"))
    assert done.json()["last_chunk_index"] == 0
    ids = published(tmp_path)["00000_chunk_0.jsonl"]
    if late.status_code == 200:
        assert ids == ["a", "late"]  # it was in before the chunk closed
    else:
        assert late.status_code == 409  # refused: nothing acknowledged is missing
        assert ids == ["a"]


async def test_zst_output_names_compress(tmp_path: Path) -> None:
    import zstandard

    settings = config(tmp_path, "http://127.0.0.1:9", output_filename="${rank}_chunk_${chunk_index}.jsonl.zst")
    async with proxy_client(settings) as c:
        await post(c, [doc("a"), doc("b"), doc("c")])
    data = zstandard.ZstdDecompressor().decompress((tmp_path / "out" / "00000_chunk_0.jsonl.zst").read_bytes())
    assert [json.loads(line)["id"] for line in data.decode().splitlines()] == ["a", "b", "c"]


async def test_a_crash_while_publishing_leaves_no_output_and_a_restart_publishes_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_replace = os.replace

    def crash(src: str, dst: str) -> None:
        if str(dst).startswith(str(tmp_path / "out")):
            raise OSError(errno.EIO, "simulated crash before the rename")
        real_replace(src, dst)

    async with proxy_client(config(tmp_path, "http://127.0.0.1:9")) as c:
        await post(c, doc("first-write-opens-everything"), chunk=5)
        monkeypatch.setattr(os, "replace", crash)
        answer = await post(c, [doc("a"), doc("b"), doc("c")])
        assert answer.status_code == 200  # durable in the checkpoints: the publication follows
        assert (await c.get("/resume")).status_code == 503
        monkeypatch.undo()
        assert published(tmp_path) == {}
        assert os.listdir(tmp_path / "out") == []  # no partial file left behind either
    async with proxy_client(config(tmp_path, "http://127.0.0.1:9")) as c:
        # the rank is restored on its first request, and its full chunk published then
        assert (await c.get("/resume")).json()["last_chunk_index"] == 0
        assert published(tmp_path) == {"00000_chunk_0.jsonl": ["a", "b", "c"]}
        assert (await post(c, doc("d"), chunk=0)).status_code == 409


async def test_many_ranks_and_chunks_written_concurrently_publish_exactly_once(tmp_path: Path) -> None:
    import asyncio

    async with proxy_client(config(tmp_path, "http://127.0.0.1:9")) as c:

        async def one(rank: int, i: int) -> int:
            answer = await post(c, doc(f"r{rank}-{i}"), chunk=i // 3, rank=rank)
            return answer.status_code

        statuses = await asyncio.gather(*(one(rank, i) for rank in range(4) for i in range(9)))
        assert set(statuses) == {200}
    files = published(tmp_path)
    assert sorted(files) == [f"{r:05d}_chunk_{k}.jsonl" for r in range(4) for k in range(3)]
    for rank in range(4):
        ids = sorted(i for k in range(3) for i in files[f"{rank:05d}_chunk_{k}.jsonl"])
        assert ids == sorted(f"r{rank}-{i}" for i in range(9))


async def test_completing_a_chunk_twice_is_harmless(client: httpx.AsyncClient, tmp_path: Path) -> None:
    await post(client, [doc("a")], chunk=0)
    first = await client.post("/chunks/0/complete")
    again = await client.post("/chunks/0/complete")
    assert first.json() == again.json() == {"rank": 0, "last_chunk_index": 0, "pending": []}
    assert published(tmp_path) == {"00000_chunk_0.jsonl": ["a"]}


async def test_resume_for_a_rank_never_used_creates_no_files(client: httpx.AsyncClient, tmp_path: Path) -> None:
    answer = await client.get("/resume", headers={"X-Rank": "7"})
    assert answer.json() == {
        "rank": 7,
        "records_per_chunk": 3,
        "last_chunk_index": -1,
        "docs_to_skip": 0,
        "processed_ids": [],
        "output": str(tmp_path / "out"),
        "output_filename": "${rank}_chunk_${chunk_index}.jsonl",
    }
    assert not (tmp_path / "ckpt" / "00007").exists()


async def test_integers_out_of_range_in_headers_and_paths_are_refused(client: httpx.AsyncClient) -> None:
    # each was a 500 (int() of 5000 digits, orjson or SQLite past 64 bits), one after writing the document
    for chunk in ("9" * 5000, str(2**64)):
        answer = await client.post("/documents", json=doc("a"), headers={"X-Rank": "0", "X-Chunk-Index": chunk})
        assert answer.status_code == 400, chunk
        assert answer.json()["error"]["param"] == "X-Chunk-Index"
        answer = await client.post(f"/chunks/{chunk}/complete", headers={"X-Rank": "0"})
        assert answer.status_code == 400, chunk
    answer = await client.get("/resume", headers={"X-Rank": "9" * 5000})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "X-Rank"
    assert (await client.get("/resume")).json()["processed_ids"] == []  # nothing was written


async def test_a_chunk_whose_checkpoint_file_vanished_is_not_reported_complete(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    # The rank dir removed under a running proxy (an operator's rm -rf, a wiped scratch disk): the chunk's
    # documents are in no file any more. Publishing found nothing, published nothing, and moved last_chunk
    # past the chunk: its documents were lost without a word.
    assert (await post(client, [doc("a"), doc("b")], rank=5)).status_code == 200
    shutil.rmtree(tmp_path / "ckpt" / "00005")
    answer = await post(client, doc("c"), rank=5)
    assert answer.status_code == 200  # its own line is durable (in a new file): the publication fails
    resume = await client.get("/resume", headers={"X-Rank": "5"})
    assert resume.status_code == 500  # not an outage: no retry brings the documents back
    assert "checkpoint file" in resume.json()["error"]["message"]
    assert "is gone" in resume.json()["error"]["message"]
    assert not (tmp_path / "ckpt" / "last_chunk" / "00005.txt").exists()
    # Said once: the chunk is forgotten, as a restarted proxy would find it, and the job generates it again
    # (it met this 500 at every resume for as long as the proxy kept the rank open).
    resume = await client.get("/resume", headers={"X-Rank": "5"})
    assert resume.status_code == 200
    assert (resume.json()["last_chunk_index"], resume.json()["processed_ids"]) == (-1, [])


async def test_a_rank_first_named_by_a_v1_request_still_resumes_from_the_output(tmp_path: Path) -> None:
    # Checkpoints lost, chunks 0 and 1 of rank 0 published. The rank's first request is a generation:
    # opening its cache created the rank dir, which then counted as "checkpoints", so /resume said
    # last_chunk_index -1 and the whole rank was generated again.
    (tmp_path / "out").mkdir()
    for i in range(2):
        (tmp_path / "out" / f"00000_chunk_{i}.jsonl").write_text(json.dumps({"id": f"d{i}", "text": "t"}) + "\n")
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as client:
        answer = await client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "p"}, headers={"X-Rank": "0", "X-Doc-Id": "d6"}
        )
        assert answer.status_code == 200
        resume = (await client.get("/resume", headers={"X-Rank": "0"})).json()
        assert (resume["last_chunk_index"], resume["docs_to_skip"]) == (1, 6)


async def test_a_rank_resumed_from_the_output_is_recorded_as_this_proxys_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Recovery wrote last_chunk without checkpoint_meta.json, so the next use of the dir warned that
    # it held checkpoints "written by datatrove or an older inferproxy".
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "00000_chunk_0.jsonl").write_text(json.dumps({"id": "d0", "text": "t"}) + "\n")
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as client:
        with caplog.at_level(logging.WARNING):
            assert (await client.get("/resume")).json()["last_chunk_index"] == 0
            assert (await post(client, [doc("d3"), doc("d4")], chunk=1)).status_code == 200
            assert (await client.post("/chunks/1/complete")).json()["last_chunk_index"] == 1
    assert json.loads((tmp_path / "ckpt" / "checkpoint_meta.json").read_text()) == {"records_per_chunk": 3}
    assert "resuming after chunk 0" in caplog.text
    assert "no checkpoint_meta.json" not in caplog.text


async def test_recovering_from_the_output_logs_no_credential_of_its_url(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import fsspec

    output = f"memory://user:s3cret@{tmp_path.name}/prefix"
    fs, root = fsspec.core.url_to_fs(output)
    fs.pipe_file(f"{root}/00000_chunk_0.jsonl", b'{"id": "d0", "text": "t"}\n')
    try:
        async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url, output=output)) as client:
            with caplog.at_level(logging.INFO):
                resume = (await client.get("/resume", headers={"X-Rank": "0"})).json()
    finally:
        fs.rm(root, recursive=True)
    assert resume["last_chunk_index"] == 0
    assert "chunks 0..0 of it are published in memory://***@" in caplog.text
    assert "s3cret" not in caplog.text


async def test_resume_reports_a_relative_output_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = config(tmp_path, "http://127.0.0.1:9", output="published", output_filename="${rank}-${chunk_index}.gz")
    async with proxy_client(settings) as c:
        answer = (await c.get("/resume")).json()
    assert (answer["output"], answer["output_filename"]) == (str(tmp_path / "published"), "${rank}-${chunk_index}.gz")


@pytest.mark.parametrize(
    ("output", "shown"),
    [
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("s3://AKIA123:s3cr3t@bucket/prefix/", "s3://bucket/prefix/"),
        ("https://user:pw@example.org:8443/out?token=abc#x", "https://example.org:8443/out"),
        ("file:///data/out", "/data/out"),
    ],
)
def test_resume_never_shows_credentials_embedded_in_the_output_url(output: str, shown: str) -> None:
    assert public_output(output) == shown


#: A link in a rank's files, made by anyone who can write in a shared checkpoints dir: where it is.
PLANTED_LINKS = {
    "chunk file": "00007/chunk_00001.jsonl",  # its "torn last line" was cut: the victim emptied
    "request cache": "00007/replay.sqlite3",  # SQLite made the (empty) victim a database
    "cache's WAL": "00007/replay.sqlite3-wal",
    "owner lock": "owners/00007.lock",  # claiming the rank truncated the victim and wrote in it
    "last_chunk file": "last_chunk/00007.txt",  # read through: its bytes in the log, a FIFO hung the proxy
    "rank folder": "00007",  # the proxy created its cache and chunk files in the folder linked to
}


@pytest.mark.parametrize("planted", PLANTED_LINKS.values(), ids=PLANTED_LINKS.keys())
async def test_a_link_planted_in_a_ranks_files_is_refused_and_what_it_points_to_is_left_alone(
    client: httpx.AsyncClient, tmp_path: Path, planted: str
) -> None:
    link = tmp_path / "ckpt" / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "ckpt" / "00007").mkdir(exist_ok=True)
    if planted == "00007":
        (tmp_path / "ckpt" / "00007").rmdir()
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "keep.txt").write_bytes(b"precious")
    else:
        (tmp_path / "ckpt" / "00007" / "chunk_00000.jsonl").write_bytes(b'{"id":"a","text":"a"}\n')
        victim = tmp_path / "victim.txt"
        victim.write_bytes(b"" if "sqlite3" in planted else b"precious, without a newline")
    before = {path: path.read_bytes() for path in [victim, *victim.rglob("*")] if path.is_file()}
    link.symlink_to(victim)

    answer = await client.get("/resume", headers={"X-Rank": "7"})
    assert answer.status_code == 500
    message = answer.json()["error"]["message"]
    assert f"{link} is a symbolic link, not " in message
    assert "Remove it, or put the " in message
    assert {path: path.read_bytes() for path in [victim, *victim.rglob("*")] if path.is_file()} == before
    assert link.is_symlink()

    link.unlink()  # what the message says to do: the rank is served again
    answer = await client.get("/resume", headers={"X-Rank": "7"})
    assert answer.status_code == 200


@pytest.mark.parametrize("restored", [True, False], ids=["with-chunk-files", "last-chunk-only"])
async def test_a_last_chunk_file_beyond_any_chunk_index_is_read_as_a_corrupt_one(
    client: httpx.AsyncClient, tmp_path: Path, caplog: pytest.LogCaptureFixture, restored: bool
) -> None:
    # Was a 500: SQLite cannot hold the number (CacheWriteError), nor orjson docs_to_skip.
    last_chunk = tmp_path / "ckpt" / "last_chunk" / "00007.txt"
    last_chunk.parent.mkdir(parents=True)
    last_chunk.write_text("99999999999999999999999999999")
    if restored:
        (tmp_path / "ckpt" / "00007").mkdir()
        (tmp_path / "ckpt" / "00007" / "chunk_00000.jsonl").write_bytes(b'{"id":"a","text":"a"}\n')
    with caplog.at_level(logging.WARNING):
        answer = await client.get("/resume", headers={"X-Rank": "7"})
    assert answer.status_code == 200
    assert (answer.json()["last_chunk_index"], answer.json()["docs_to_skip"]) == (-1, 0)
    assert f"{last_chunk} is empty or unreadable ('99999999999999999999999999999'): not a chunk index" in caplog.text


async def test_a_resume_listing_the_output_meanwhile_never_moves_last_chunk_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checkpoints lost, chunk 0 of rank 0 published. GET /resume recovers the rank from the output (a
    # listing that takes seconds on a big bucket); meanwhile the rank opens (its own recovery, done), and
    # chunk 1 fills and is published: last_chunk is 1. The slow recovery then wrote its stale 0 over it,
    # and a restarted job generated chunk 1 again.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "00000_chunk_0.jsonl").write_text(json.dumps({"id": "d0", "text": "t"}) + "\n")
    listing, done = threading.Event(), threading.Event()
    real = ChunkPublisher.last_published_chunk
    calls = []

    def slow_first(self: ChunkPublisher, rank: int) -> int:
        calls.append(rank)
        last = real(self, rank)
        if len(calls) == 1:
            listing.set()
            done.wait(30)
        return last

    monkeypatch.setattr(ChunkPublisher, "last_published_chunk", slow_first)
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as client:
        resume = asyncio.create_task(client.get("/resume", headers={"X-Rank": "0"}))
        await asyncio.to_thread(listing.wait, 10)
        writing = asyncio.create_task(post(client, [doc("d3"), doc("d4"), doc("d5")], chunk=1))
        # Unfixed, the chunk is written and published within this; fixed, the write waits for the listing.
        await asyncio.wait({writing}, timeout=1.0)
        done.set()
        written = await writing
        assert written.status_code == 200, written.text
        answers = [await resume, await client.get("/resume", headers={"X-Rank": "0"})]
    assert "00000_chunk_1.jsonl" in published(tmp_path)
    assert answers[1].json()["last_chunk_index"] == 1
    assert (tmp_path / "ckpt" / "last_chunk" / "00000.txt").read_text() == "1"

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from datatrove.pipeline.inference.checkpointing import RequestCache as DatatroveRequestCache

import app.store.cache
from app.store.cache import (
    MIGRATIONS,
    CacheWriteError,
    RequestCache,
    StoredResponse,
    apply_migrations,
    count_rows,
)
from app.store.durable import is_disk_full
from app.store.hashing import payload_hash
from tests.factories import open_cache
from tests.servers import free_port, wait_for_http
from tests.waiting import eventually

PAYLOAD = {"messages": [{"role": "user", "content": "hello"}]}
ROUTES = ("/v1/chat/completions", "/v1/completions")
H = payload_hash(PAYLOAD)
RESULT = {"text": "world", "finish_reason": "stop", "usage": {"prompt_tokens": 1}, "reasoning": "scratchpad"}


async def opened(path: Path, **kwargs: Any) -> RequestCache:
    cache = RequestCache(str(path), **kwargs)
    await cache.initialize(0)
    return cache


def rows(path: Path, rank: int = 0) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path / f"{rank:05d}" / "replay.sqlite3") as conn:
        return conn.execute(
            "SELECT chunk_index, doc_id, rollout_idx, payload_hash, result, error_message FROM request_cache "
            "ORDER BY doc_id, rollout_idx"
        ).fetchall()


async def test_store_and_fetch_across_instances_as_datatrove_does(tmp_path: Path) -> None:
    cache = await opened(tmp_path)
    assert await cache.get_cached_response("doc-1", 0, payload_hash=H) == (None, None)
    await cache.store_result(0, "doc-1", 0, RESULT, payload_hash=H)
    await cache.store_error(0, "doc-2", 0, "boom", payload_hash=H)
    await cache.flush()

    resume = await opened(tmp_path)
    assert await resume.get_cached_response("doc-1", 0, payload_hash=H) == (RESULT, None)
    assert await resume.get_cached_response("doc-2", 0, payload_hash=H) == (None, "boom")
    await resume.mark_document_complete("doc-1")
    assert await resume.get_cached_response("doc-1", 0, payload_hash=H) == (None, None)
    await resume.drop_chunk(0)
    await resume.close(delete_file=True)
    await cache.close()
    assert not list(tmp_path.glob("*/replay.sqlite3"))


async def test_answers_stored_in_this_run_are_not_replayed_by_default(tmp_path: Path) -> None:
    cache = await opened(tmp_path)
    await cache.store_result(0, "doc-1", 0, RESULT, payload_hash=H)
    await cache.flush()
    assert await cache.get_cached_response("doc-1", 0, payload_hash=H) == (None, None)
    await cache.close()


async def test_replay_same_run_serves_an_answer_before_it_is_committed(tmp_path: Path) -> None:
    cache = await opened(tmp_path, replay_same_run=True, flush_interval_ms=60_000)
    await cache.store_result(3, "doc-1", 0, RESULT, payload_hash=H)
    await cache.store_error(3, "doc-1", 1, "too long", payload_hash=H)
    assert rows(tmp_path) == []  # nothing committed yet
    assert await cache.get_cached_response("doc-1", 0, payload_hash=H) == (RESULT, None)
    assert await cache.get_cached_response("doc-1", 1, payload_hash=H) == (None, "too long")
    assert await cache.get_cached_response("doc-1", 2, payload_hash=H) == (None, None)
    await cache.close()


async def test_newest_answer_for_a_key_wins(tmp_path: Path) -> None:
    cache = await opened(tmp_path, replay_same_run=True)
    await cache.store_result(0, "d", 0, {"v": 1}, payload_hash=H)
    await cache.flush()
    await cache.store_error(0, "d", 0, "later error", payload_hash=H)
    await cache.flush()
    assert await cache.get_cached_response("d", 0, payload_hash=H) == (None, "later error")
    assert len(rows(tmp_path)) == 1
    await cache.close()


async def test_stores_between_flushes_are_committed_in_one_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[int] = []
    real = app.store.cache._write_batch

    def counting(conn: sqlite3.Connection, batch: list[Any], *drop: Any) -> Any:
        batches.append(len(batch))
        return real(conn, batch, *drop)

    monkeypatch.setattr(app.store.cache, "_write_batch", counting)
    cache = await opened(tmp_path, flush_interval_ms=60_000)
    for i in range(1000):
        await cache.store_result(0, f"doc-{i}", 0, {"i": i}, payload_hash=H)
    await cache.flush()
    assert batches == [1000]
    assert len(rows(tmp_path)) == 1000
    await cache.close()


@pytest.mark.parametrize("count", [1, 3, 4, 37, 256, 293, 1000])
async def test_a_batch_of_any_size_is_written_whole_in_multi_row_statements(tmp_path: Path, count: int) -> None:
    cache = await opened(tmp_path, flush_interval_ms=60_000)
    await cache.store_result(7, "doc-0", 0, {"old": True}, payload_hash=H)
    await cache.flush()
    for i in range(count):  # doc-0 again among them: its newer answer replaces the committed one
        await cache.store_result(i % 3, f"doc-{i}", i % 2, {"i": i}, payload_hash=H)
    await cache.flush()
    stored = rows(tmp_path)
    assert len(stored) == count
    assert {(r[0], r[1], r[2]) for r in stored} == {(i % 3, f"doc-{i}", i % 2) for i in range(count)}
    reader = await opened(tmp_path)
    for i in (0, count // 2, count - 1):
        assert await reader.get_cached_response(f"doc-{i}", i % 2, payload_hash=H) == ({"i": i}, None)
    await reader.close()
    await cache.close()


async def test_writer_commits_on_its_own_within_the_flush_window(tmp_path: Path) -> None:
    cache = await opened(tmp_path, flush_interval_ms=5)
    await cache.store_result(0, "doc-1", 0, RESULT, payload_hash=H)
    for _ in range(400):  # bounded wait: up to ~4 s on a loaded machine
        if rows(tmp_path):
            break
        await asyncio.sleep(0.01)
    assert [r[1] for r in rows(tmp_path)] == ["doc-1"]
    await cache.close()


async def test_drop_chunk_deletes_committed_and_pending_rows_of_that_chunk_only(tmp_path: Path) -> None:
    cache = await opened(tmp_path, flush_interval_ms=60_000)
    await cache.store_result(0, "a", 0, {"v": "a"}, payload_hash=H)
    await cache.flush()
    await cache.store_result(0, "b", 0, {"v": "b"}, payload_hash=H)  # pending
    await cache.store_result(1, "c", 0, {"v": "c"}, payload_hash=H)
    await cache.drop_chunk(0)
    assert [r[1] for r in rows(tmp_path)] == ["c"]
    await cache.close()


async def test_flush_failure_raises_and_keeps_the_rows_for_the_next_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = app.store.cache._write_batch
    calls = 0

    def failing_once(conn: sqlite3.Connection, batch: list[Any], *drop: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return real(conn, batch, *drop)

    monkeypatch.setattr(app.store.cache, "_write_batch", failing_once)
    cache = await opened(tmp_path, flush_interval_ms=60_000)
    await cache.store_result(0, "a", 0, {"v": 1}, payload_hash=H)
    with pytest.raises(CacheWriteError, match="disk is full"):
        await cache.flush()
    await cache.store_result(0, "b", 0, {"v": 2}, payload_hash=H)
    await cache.flush()
    assert [r[1] for r in rows(tmp_path)] == ["a", "b"]
    await cache.close()


async def test_a_commit_a_full_disk_refuses_is_a_cache_write_error_caused_by_it(tmp_path: Path) -> None:
    # The checkpoint routes answer 507 for it, not 500, by asking the cause.
    cache = await opened(tmp_path, flush_interval_ms=60_000)
    assert cache._writer is not None
    pages = cache._writer.execute("PRAGMA page_count").fetchone()[0]
    cache._writer.execute(f"PRAGMA max_page_count = {pages}")  # SQLite refuses to grow the file, as on a full disk
    await cache.store_result(0, "a", 0, {"v": "x" * 100_000}, payload_hash=H)
    with pytest.raises(CacheWriteError, match="database or disk is full") as refused:
        await cache.flush()
    assert is_disk_full(refused.value.__cause__)
    cache._writer.execute(f"PRAGMA max_page_count = {2**30}")  # space freed: the queued row is committed
    await cache.flush()
    assert [r[1] for r in rows(tmp_path)] == ["a"]
    await cache.close()


async def test_a_drop_the_disk_refused_stays_queued_and_the_writer_does_it_once_it_can(tmp_path: Path) -> None:
    cache = await opened(tmp_path, flush_interval_ms=10)
    await cache.store_result(0, "a", 0, {"v": "a"}, payload_hash=H)
    await cache.store_result(1, "b", 0, {"v": "b"}, payload_hash=H)
    await cache.flush()
    assert cache._writer is not None
    pages = cache._writer.execute("PRAGMA page_count").fetchone()[0]
    cache._writer.execute(f"PRAGMA max_page_count = {pages}")
    await cache.store_result(1, "c", 0, {"v": "x" * 100_000}, payload_hash=H)
    with pytest.raises(CacheWriteError, match="database or disk is full"):
        await cache.drop_chunk(0)
    assert [r[1] for r in rows(tmp_path)] == ["a", "b"]
    cache._writer.execute(f"PRAGMA max_page_count = {2**30}")  # space freed: nobody asks for the drop again
    await eventually(lambda: [r[1] for r in rows(tmp_path)] == ["b", "c"], "the queued drop was never done")
    await cache.close()


async def test_an_answer_stored_for_a_route_is_found_for_it_only_and_datatroves_for_any(tmp_path: Path) -> None:
    cache = await opened(tmp_path, flush_interval_ms=60_000, replay_same_run=True)  # as the proxy's
    answer = StoredResponse(200, b'{"object": "chat.completion"}', "application/json", False)
    cache.store_response(0, "a", 0, H, answer, endpoint="/v1/chat/completions")
    await cache.store_result(0, "d", 0, {"text": "datatrove's"}, payload_hash=H)  # no route: datatrove's own
    for committed in (False, True):  # pending, then read back from the file
        assert cache.get_response("a", 0, H, endpoint="/v1/chat/completions") == answer
        assert cache.get_response("a", 0, H, endpoint="/v1/completions") is None
        assert cache.get_response("a", 0, H) == answer  # no route asked: any
        for endpoint in ("/v1/chat/completions", "/v1/completions"):
            assert cache.get_response("d", 0, H, endpoint=endpoint) is not None
        if not committed:
            await cache.flush()
    await cache.close()


async def test_a_row_stored_before_routes_were_kept_is_served_to_the_route_its_answer_names(tmp_path: Path) -> None:
    """Upgraded, a cache kept serving an old row to either route: a 400 the wrong route got, to the right one."""
    cache = await opened(tmp_path, flush_interval_ms=60_000, replay_same_run=True)
    assert cache._writer is not None
    old = {
        "chat": (200, b'{"id": "c", "object": "chat.completion", "choices": []}'),
        "text": (200, b'{"id":"t","object":"text_completion","choices":[]}'),
        "stream": (200, b'data: {"id":"s","object":"chat.completion.chunk"}\n\ndata: [DONE]\n\n'),
        "error": (400, b'{"error": {"message": "messages: Field required"}}'),
    }
    for doc_id, (status, body) in old.items():  # as an inferproxy wrote them before migration 0003
        cache._writer.execute(
            "INSERT INTO request_cache (chunk_index, doc_id, rollout_idx, payload_hash, result, status_code, "
            "content_type, streamed) VALUES (0, ?, 0, ?, ?, ?, 'application/json', 0)",
            (doc_id, H, body, status),
        )
    served = {
        doc_id: [cache.get_response(doc_id, 0, H, endpoint=route) is not None for route in ROUTES] for doc_id in old
    }
    assert served == {"chat": [True, False], "text": [False, True], "stream": [True, False], "error": [False, False]}
    assert all(cache.get_response(doc_id, 0, H) is not None for doc_id in old)  # no route asked: any
    await cache.close()


async def test_caches_opening_one_new_file_together_all_open_it(tmp_path: Path) -> None:
    # Proxies started together on one checkpoints dir open its files together. Switching a new file to WAL
    # takes its exclusive lock, and SQLite refuses that at once, without waiting, while another connection
    # holds a lock it needs: one proxy in three of CI's started that way died with "database is locked".
    async def open_and_store(folder: Path) -> None:
        cache = await opened(folder)
        await cache.store_result(0, f"doc-{threading.get_ident()}", 0, RESULT, payload_hash=H)
        await cache.close()

    def open_at_once(folder: Path, barrier: threading.Barrier) -> None:
        barrier.wait()
        asyncio.run(open_and_store(folder))

    for round_ in range(30):
        (tmp_path / str(round_) / "00000").mkdir(parents=True)
        barrier = threading.Barrier(4)
        with ThreadPoolExecutor(4) as pool:
            opening = [pool.submit(open_at_once, tmp_path / str(round_), barrier) for _ in range(4)]
        assert [future.exception() for future in opening] == [None] * 4
        reopened = await opened(tmp_path / str(round_))
        assert await asyncio.to_thread(count_rows, str(reopened.db_path)) == 4
        await reopened.close()


async def test_disabled_cache_is_a_no_op(tmp_path: Path) -> None:
    cache = RequestCache(None)
    assert cache.enabled is False
    await cache.initialize(0)
    await cache.store_result(0, "a", 0, {"v": 1}, payload_hash=H)
    await cache.store_error(0, "a", 0, "e", payload_hash=H)
    assert await cache.get_cached_response("a", 0, payload_hash=H) == (None, None)
    await cache.flush()
    await cache.drop_chunk(0)
    await cache.mark_document_complete("a")
    await cache.close(delete_file=True)
    assert list(tmp_path.iterdir()) == []


async def test_a_close_whose_caller_is_cancelled_closes_the_file_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rank released (its lock let go) while its cache's close was cut: the SQLite connections stayed open.
    writer_loop = RequestCache._writer_loop
    stopping, stop = asyncio.Event(), asyncio.Event()

    async def slow_to_stop(self: Any) -> None:
        try:
            await writer_loop(self)
        finally:
            stopping.set()
            await stop.wait()

    monkeypatch.setattr(RequestCache, "_writer_loop", slow_to_stop)
    cache = await open_cache(tmp_path)
    await cache.store_result(0, "d", 0, {"r": 1}, payload_hash="h")
    closing = asyncio.create_task(cache.close())
    await stopping.wait()
    closing.cancel()
    stop.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert (cache._reader, cache._writer, cache.db_path) == (None, None, None)
    reopened = await open_cache(tmp_path)
    assert await reopened.get_cached_response("d", 0, payload_hash="h") == ({"r": 1}, None)
    await reopened.close()


async def test_close_is_idempotent_and_delete_file_removes_wal_files(tmp_path: Path) -> None:
    cache = await opened(tmp_path)
    await cache.store_result(0, "a", 0, {"v": 1}, payload_hash=H)
    await cache.close(delete_file=True)
    await cache.close(delete_file=True)
    assert os.listdir(tmp_path / "00000") == []


def test_migrations_from_a_blank_file_create_datatrove_table_plus_response_columns(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "blank.sqlite3", isolation_level=None)
    assert apply_migrations(conn) == [name for name, _ in MIGRATIONS]
    columns = [row[1] for row in conn.execute("PRAGMA table_info(request_cache)")]
    assert columns == [
        "chunk_index",
        "doc_id",
        "rollout_idx",
        "payload_hash",
        "result",
        "error_message",
        "status_code",
        "content_type",
        "streamed",
        "endpoint",
    ]
    primary_key = sorted((row[5], row[1]) for row in conn.execute("PRAGMA table_info(request_cache)") if row[5])
    assert [name for _, name in primary_key] == ["doc_id", "rollout_idx", "payload_hash"]
    assert apply_migrations(conn) == []  # recorded by name: never applied twice
    conn.close()


async def test_a_cache_written_by_datatrove_is_migrated_and_read(tmp_path: Path) -> None:
    theirs = DatatroveRequestCache(str(tmp_path))
    await theirs.initialize(0)
    await theirs.store_result(2, "doc-1", 0, RESULT, payload_hash=H)
    await theirs.store_error(2, "doc-2", 1, "boom", payload_hash=H)
    await theirs.close()

    ours = await opened(tmp_path)
    assert await ours.get_cached_response("doc-1", 0, payload_hash=H) == (RESULT, None)
    assert await ours.get_cached_response("doc-2", 1, payload_hash=H) == (None, "boom")
    await ours.drop_chunk(2)
    assert rows(tmp_path) == []
    await ours.close()


async def test_a_cache_written_by_inferproxy_is_read_by_datatrove(tmp_path: Path) -> None:
    ours = await opened(tmp_path)
    await ours.store_result(0, "doc-1", 0, RESULT, payload_hash=H)
    await ours.store_error(0, "doc-2", 0, "boom", payload_hash=H)
    await ours.close()

    theirs = DatatroveRequestCache(str(tmp_path))
    await theirs.initialize(0)
    assert await theirs.get_cached_response("doc-1", 0, payload_hash=H) == (RESULT, None)
    assert await theirs.get_cached_response("doc-2", 0, payload_hash=H) == (None, "boom")
    await theirs.store_result(0, "doc-3", 0, {"x": 1}, payload_hash=H)  # its 6-column INSERT still works
    await theirs.close()
    assert [r[1] for r in rows(tmp_path)] == ["doc-1", "doc-2", "doc-3"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, None, 0), "doc_id must be a str"),
        ((0, "d", "1"), "rollout_idx must be a 64-bit integer"),
        ((2**64, "d", 0), "chunk_index must be a 64-bit integer"),
    ],
)
async def test_a_key_sqlite_cannot_store_is_refused_at_store_time(
    tmp_path: Path, args: tuple[Any, Any, Any], message: str
) -> None:
    cache = await opened(tmp_path)
    await cache.store_result(0, "good", 0, {"v": 1}, payload_hash=H)
    with pytest.raises(TypeError, match=message):
        await cache.store_result(args[0], args[1], args[2], {"v": 2}, payload_hash=H)
    await cache.flush()  # the good row is not held hostage by the bad one
    assert [r[1] for r in rows(tmp_path)] == ["good"]
    await cache.close()


async def test_an_error_message_with_undecodable_bytes_is_stored(tmp_path: Path) -> None:
    cache = await opened(tmp_path)
    await cache.store_error(0, "d", 0, "upstream said \udcff", payload_hash=H)
    await cache.close()
    assert rows(tmp_path)[0][5] == "upstream said ?"


async def test_any_failure_in_a_commit_keeps_the_rows_and_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = app.store.cache._write_batch
    calls = 0

    def flaky(conn: sqlite3.Connection, batch: list[Any], *drop: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("something unexpected")
        return real(conn, batch, *drop)

    monkeypatch.setattr(app.store.cache, "_write_batch", flaky)
    cache = await opened(tmp_path, flush_interval_ms=1)
    await cache.store_result(0, "a", 0, {"v": 1}, payload_hash=H)
    for _ in range(500):  # bounded: the writer retries on its own
        if rows(tmp_path):
            break
        await asyncio.sleep(0.01)
    assert [r[1] for r in rows(tmp_path)] == ["a"]
    assert cache._writer_task is not None
    assert not cache._writer_task.done()
    await cache.close()


async def test_a_cancelled_flush_keeps_the_lock_until_its_commit_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    real = app.store.cache._write_batch
    running = 0
    overlap = False
    gate = threading.Event()

    def slow(conn: sqlite3.Connection, batch: list[Any], *drop: Any) -> Any:
        nonlocal running, overlap
        running += 1
        overlap = overlap or running > 1
        gate.wait(2)
        try:
            return real(conn, batch, *drop)
        finally:
            running -= 1

    monkeypatch.setattr(app.store.cache, "_write_batch", slow)
    cache = await opened(tmp_path, flush_interval_ms=60_000)
    await cache.store_result(0, "first", 0, {"v": 1}, payload_hash=H)
    flush = asyncio.create_task(cache.flush())
    await asyncio.sleep(0.05)
    flush.cancel()
    await cache.store_result(0, "second", 0, {"v": 2}, payload_hash=H)
    second = asyncio.create_task(cache.flush())
    await asyncio.sleep(0.05)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await flush
    await second
    assert not overlap
    assert [r[1] for r in rows(tmp_path)] == ["first", "second"]
    await cache.close()


async def test_drop_chunk_racing_close_is_harmless(tmp_path: Path) -> None:
    cache = await opened(tmp_path)
    await cache.store_result(3, "a", 0, {"v": 1}, payload_hash=H)
    results = await asyncio.gather(cache.close(), cache.drop_chunk(3), return_exceptions=True)
    assert results == [None, None]
    await cache.drop_chunk(3)  # after close: nothing to do, nothing raised
    assert [r[1] for r in rows(tmp_path)] in ([], ["a"])  # whichever ran first


@pytest.mark.parametrize("unwritable", ["rank dir", "cache file"])
def test_a_rank_whose_cache_cannot_be_written_is_503_naming_it_without_a_traceback(
    tmp_path: Path, unwritable: str
) -> None:
    # A rank dir (or its cache file) another user left, or made read-only, in a checkpoints dir the proxy may
    # write: SQLite says only "unable to open database file" (or "attempt to write a readonly database"),
    # which was a 500 with a traceback logged for every request of the rank. Mode 555 stops only a process
    # without CAP_DAC_OVERRIDE: as root, the proxy runs without any capability.
    without_capabilities = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    checkpoints = tmp_path / "ckpt"
    rank_dir = checkpoints / "00000"
    rank_dir.mkdir(parents=True)
    refused = rank_dir
    if unwritable == "cache file":
        with sqlite3.connect(rank_dir / "replay.sqlite3") as conn:
            apply_migrations(conn)
        refused = rank_dir / "replay.sqlite3"
    refused.chmod(0o444 if unwritable == "cache file" else 0o555)
    port = free_port()
    log = tmp_path / "serve.log"
    try:
        with log.open("wb") as out:
            proxy = subprocess.Popen(
                [
                    *without_capabilities,
                    *(sys.executable, "-m", "app.cli", "serve", "--upstream=http://127.0.0.1:9", f"--port={port}"),
                    *(f"--checkpoints-dir={checkpoints}", f"--output={tmp_path / 'out'}"),
                ],
                stderr=out,
            )
        try:
            wait_for_http(f"http://127.0.0.1:{port}/healthz")
            answers = [
                httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "m", "messages": []},
                    headers={"X-Doc-Id": "d"},
                ),
                httpx.get(f"http://127.0.0.1:{port}/resume"),
            ]
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    finally:
        refused.chmod(0o755 if unwritable == "rank dir" else 0o644)
    for answer in answers:
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert message.startswith("rank 0 cannot be opened: the checkpoints dir cannot be written (Permission denied")
        assert f"{refused}), and nothing of this request was written; make {checkpoints} writable" in message
    assert "Traceback" not in log.read_text()

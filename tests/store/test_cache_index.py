"""Which documents the cache serves, without a copy of their ids in memory: SQLite's index says which
have answers; ids marked complete are misses without a query; without `replay_same_run`, only
documents answered before `initialize` are served. Memory is checked per entry, never timed."""

from __future__ import annotations

import asyncio
import sqlite3
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import app.store.cache
from app.store.cache import DB_FILENAME, RequestCache, StoredResponse, apply_migrations
from app.store.hashing import payload_hash

H = payload_hash({"messages": [{"role": "user", "content": "hello"}]})
ANSWER = StoredResponse(200, b'{"choices": []}', "application/json")


async def opened(path: Path, **kwargs: Any) -> RequestCache:
    cache = RequestCache(str(path), **kwargs)
    await cache.initialize(0)
    return cache


def queries(cache: RequestCache) -> list[str]:
    """The SQL the cache's lookups run from now on."""
    seen: list[str] = []
    assert cache._reader is not None
    cache._reader.set_trace_callback(seen.append)
    return seen


def fill(root: Path, entries: int, *, chunk_of: Any = lambda i: 0) -> list[str]:
    """A cache file of `entries` answers, one a document, written straight into SQLite; their doc ids."""
    (root / "00000").mkdir(parents=True)
    ids = [f"doc-{i:08d}" for i in range(entries)]
    conn = sqlite3.connect(root / "00000" / DB_FILENAME, isolation_level=None)
    apply_migrations(conn)
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO request_cache (chunk_index, doc_id, rollout_idx, payload_hash, result, status_code, "
        "content_type) VALUES (?, ?, 0, ?, ?, 200, 'application/json')",
        ((chunk_of(i), doc_id, H, ANSWER.body) for i, doc_id in enumerate(ids)),
    )
    conn.execute("COMMIT")
    conn.close()
    return ids


async def test_a_document_marked_complete_is_a_miss_without_a_query(tmp_path: Path) -> None:
    cache = await opened(tmp_path, replay_same_run=True, flush_interval_ms=60_000)
    cache.store_response(0, "committed", 0, H, ANSWER)
    await cache.flush()
    cache.store_response(0, "pending", 0, H, ANSWER)  # not committed yet
    for doc_id in ("committed", "pending", "never-answered"):
        await cache.mark_document_complete(doc_id)
    seen = queries(cache)
    for doc_id in ("committed", "pending"):
        assert cache.get_response(doc_id, 0, H) is None
        assert await cache.get_cached_response(doc_id, 0, payload_hash=H) == (None, None)
    assert cache.get_response("never-answered", 0, H) is None
    assert seen == []
    await cache.close()


async def test_a_stored_answer_is_found_among_many(tmp_path: Path) -> None:
    ids = fill(tmp_path, 50_000)
    cache = await opened(tmp_path, replay_same_run=True)
    for doc_id in ids[::997]:
        assert cache.get_response(doc_id, 0, H) == ANSWER
        assert cache.get_response(doc_id, 1, H) is None  # another rollout of it: not stored
    assert cache.get_response("doc-x", 0, H) is None
    await cache.close()


async def test_a_document_answered_again_after_it_was_marked_complete_is_served_again(tmp_path: Path) -> None:
    cache = await opened(tmp_path, replay_same_run=True)
    cache.store_response(0, "a", 0, H, ANSWER)
    await cache.mark_document_complete("a")
    cache.store_response(0, "a", 1, H, ANSWER)
    assert cache.get_response("a", 0, H) == ANSWER
    assert cache.get_response("a", 1, H) == ANSWER
    await cache.close()


async def test_completed_documents_without_answers_are_forgotten_those_with_answers_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app.store.cache, "SWEEP_COMPLETE_FROM", 0)  # every commit looks them over
    cache = await opened(tmp_path, replay_same_run=True, flush_interval_ms=60_000)
    cache.store_response(1, "both", 0, H, ANSWER)
    cache.store_response(-1, "both", 1, H, ANSWER)  # sent without X-Chunk-Index: no chunk drops it
    cache.store_response(1, "only", 0, H, ANSWER)
    for doc_id in ("both", "only", "unanswered", "answered-later"):
        await cache.mark_document_complete(doc_id)
    await cache.drop_chunk(1)
    cache.store_response(0, "answered-later", 0, H, ANSWER)  # not committed yet
    await cache.mark_document_complete("answered-later")
    await cache.drop_chunk(2)  # a commit: it looks them over
    # "only" and "unanswered" have no answer (left): nothing to remember them for
    assert cache._complete == {"both", "answered-later"}
    for doc_id, rollout in (("both", 1), ("only", 0), ("answered-later", 0)):
        assert cache.get_response(doc_id, rollout, H) is None
    await cache.close()


async def test_the_writer_looks_completed_documents_over_on_its_own_once_they_pile_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app.store.cache, "SWEEP_COMPLETE_FROM", 2)
    cache = await opened(tmp_path, replay_same_run=True, flush_interval_ms=1)
    for doc_id in ("a", "b", "c"):  # none answered: a job that uses the checkpoints alone
        await cache.mark_document_complete(doc_id)
    for _ in range(500):  # bounded: the writer wakes within its flush interval
        if not cache._complete:
            break
        await asyncio.sleep(0.01)
    assert cache._complete == set()
    assert cache.get_response("a", 0, H) is None
    await cache.close()


async def test_without_replay_same_run_only_documents_answered_before_initialize_are_served(tmp_path: Path) -> None:
    before = await opened(tmp_path)
    before.store_response(0, "old", 0, H, ANSWER)
    await before.close()

    cache = await opened(tmp_path)
    cache.store_response(0, "old", 1, H, ANSWER)  # a new answer for a document from before: served, as in datatrove
    cache.store_response(0, "new", 0, H, ANSWER)
    await cache.flush()
    assert cache.get_response("old", 0, H) == ANSWER
    assert cache.get_response("old", 1, H) == ANSWER
    assert cache.get_response("new", 0, H) is None
    assert await cache.get_cached_response("new", 0, payload_hash=H) == (None, None)
    await cache.close()


async def test_a_rowid_reused_after_a_drop_is_not_taken_for_an_answer_from_before(tmp_path: Path) -> None:
    before = await opened(tmp_path)
    before.store_response(5, "old", 0, H, ANSWER)
    await before.close()

    cache = await opened(tmp_path)
    await cache.drop_chunk(5)  # the table is empty again: SQLite numbers the next row 1, as "old" was
    cache.store_response(0, "new", 0, H, ANSWER)
    await cache.flush()
    with sqlite3.connect(tmp_path / "00000" / DB_FILENAME) as conn:
        assert conn.execute("SELECT rowid, doc_id FROM request_cache").fetchall() == [(1, "new")]
    assert cache.get_response("new", 0, H) is None
    await cache.close()


async def test_the_cache_holds_no_memory_per_answer_and_completed_ids_only_until_their_chunk_drops(
    tmp_path: Path,
) -> None:
    """Memory, not time, with tracemalloc: datatrove's set of doc ids costs ~95 bytes an answer."""
    entries, completed = 200_000, 50_000
    ids = fill(tmp_path, entries, chunk_of=lambda i: 0 if i < completed else 1)
    chunk = ids[:completed] + [f"unanswered-{i}" for i in range(completed)]  # chunk 0's documents
    tracemalloc.start()
    try:
        cache = await opened(tmp_path, replay_same_run=True)
        opened_bytes = tracemalloc.get_traced_memory()[0]
        for doc_id in chunk:
            await cache.mark_document_complete(doc_id)
        marked = tracemalloc.get_traced_memory()[0]
        await cache.drop_chunk(0)  # they have no answers left: the commit looks them over and forgets them
        await asyncio.sleep(0)  # the commit's finished future, still in the loop's queue, holds its result
        dropped = tracemalloc.get_traced_memory()[0]
        await cache.close()
    finally:
        tracemalloc.stop()
    assert opened_bytes / entries < 30, f"{opened_bytes / entries:.1f} bytes an answer"
    assert (marked - opened_bytes) / len(chunk) < 60  # a set slot each: the ids are the caller's strings
    assert (dropped - opened_bytes) / len(chunk) < 1

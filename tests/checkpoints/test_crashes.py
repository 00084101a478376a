"""A crash at every step of chunk completion resumes without losing or regenerating a chunk."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from app.checkpoints.manager import CheckpointManager
from tests.factories import RecordingWriter, chunk_path, documents, last_chunk_path, manager, open_cache
from tests.faults import CHUNK_COMPLETION_STEPS, SimulatedCrash

RECORDS_PER_CHUNK = 3
DOCS = documents(8)


def cached_chunks(root: Path) -> set[int]:
    with sqlite3.connect(root / "00000" / "replay.sqlite3") as conn:
        return {row[0] for row in conn.execute("SELECT DISTINCT chunk_index FROM request_cache")}


async def run_job(cm: CheckpointManager, writer: RecordingWriter, skip: int, processed: set[str]) -> None:
    """datatrove's runner loop: skip by position, then by id, write the rest, close the last chunk."""
    for position, doc in enumerate(DOCS):
        chunk_index = position // RECORDS_PER_CHUNK
        if position < skip or doc.id in processed:
            continue
        await cm.write_document(doc, 0, chunk_index, writer)
    await cm.cleanup_last_chunk(0, (len(DOCS) - 1) // RECORDS_PER_CHUNK)


@pytest.mark.parametrize("step", CHUNK_COMPLETION_STEPS)
async def test_a_crash_at_each_step_of_chunk_completion_resumes_exactly(tmp_path: Path, step: str) -> None:
    seen_at_crash: dict[str, object] = {}

    def crash(at: str) -> None:
        if at == step:
            seen_at_crash["last_chunk"] = (
                Path(last_chunk_path(tmp_path)).read_text() if os.path.exists(last_chunk_path(tmp_path)) else None
            )
            seen_at_crash["chunk_file"] = os.path.exists(chunk_path(tmp_path, 0))
            raise SimulatedCrash(at)

    cache = await open_cache(tmp_path)
    for position, doc in enumerate(DOCS):
        await cache.store_result(position // RECORDS_PER_CHUNK, doc.id, 0, {"r": doc.id}, payload_hash="h")
    await cache.flush()
    first_run = RecordingWriter()
    cm = manager(tmp_path, RECORDS_PER_CHUNK, request_cache=cache, fault=crash)
    with pytest.raises(SimulatedCrash):
        await run_job(cm, first_run, 0, set())
    await cache.close()
    if step in ("chunk_file_deleted", "cache_rows_dropped"):
        # last_chunk moved before the chunk file went: chunk 0 is never generated again
        assert seen_at_crash == {"last_chunk": "0", "chunk_file": False}

    cache = await open_cache(tmp_path)
    second_run = RecordingWriter()
    cm = manager(tmp_path, RECORDS_PER_CHUNK, request_cache=cache)
    skip, processed = await cm.parse_existing_checkpoints(0, second_run)
    assert skip == RECORDS_PER_CHUNK
    assert cm.last_chunk_index == 0
    assert 0 not in cached_chunks(tmp_path)
    assert not os.path.exists(chunk_path(tmp_path, 0))
    await run_job(cm, second_run, skip, processed)
    await cache.close(delete_file=True)

    # what a reader finds in the output: a file rewritten in the second run replaces the first run's
    published = {**first_run.files, **second_run.files}
    assert published == {
        "00000_chunk_0.jsonl": ["0", "1", "2"],
        "00000_chunk_1.jsonl": ["3", "4", "5"],
        "00000_chunk_2.jsonl": ["6", "7"],
    }
    assert Path(last_chunk_path(tmp_path)).read_text() == "2"
    assert not os.path.exists(tmp_path / "00000")


async def test_what_a_restart_reads_is_made_durable_before_a_retry_is_acknowledged_as_a_duplicate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed between a document's append and its fsync leaves it in the page cache only. The
    next process reads it and counts it processed, so the client's retry of that (never acknowledged)
    document is acknowledged as a duplicate with nothing written; a power cut then took it (the chaos
    suite's proxy kills, seed 20251201)."""
    synced: dict[str, int] = {}
    fsync = os.fsync

    def recording(fd: int) -> None:  # as tests/chaos/faulty_serve.py: the size each file had when synced
        path = os.readlink(f"/proc/self/fd/{fd}")
        size = os.fstat(fd).st_size
        fsync(fd)
        synced[path] = size

    monkeypatch.setattr(os, "fsync", recording)
    first = manager(tmp_path, RECORDS_PER_CHUNK)
    await first.write_document(DOCS[0], 0, 0, RecordingWriter())
    path = chunk_path(tmp_path, 0)
    with open(path, "ab") as f:  # the killed process's last append: written, never fsynced
        f.write(b'{"text":"text 1","id":"' + DOCS[1].id.encode() + b'"}\n')

    second = manager(tmp_path, RECORDS_PER_CHUNK)
    await second.restore(0, RecordingWriter())
    outcome = await second.write_documents([DOCS[1]], 0, 0, RecordingWriter())  # the client's retry
    assert (outcome.written, outcome.duplicates) == (0, 1)

    os.truncate(path, synced.get(os.path.realpath(path), 0))  # the power cut
    third = manager(tmp_path, RECORDS_PER_CHUNK)
    await third.restore(0, RecordingWriter())
    assert third.resume_state()[1] == sorted([DOCS[0].id, DOCS[1].id])

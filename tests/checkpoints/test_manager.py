"""The semantics of CheckpointManager: datatrove's, plus what it gets wrong fixed."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import app.checkpoints.chunkfiles
import app.store.durable
from app.checkpoints.chunk import Chunk, ChunkState
from app.checkpoints.documents import DocumentError
from app.checkpoints.manager import (
    META_FILENAME,
    CheckpointManager,
    ChunkCompleteError,
    Document,
    RecordsPerChunkMismatch,
)
from app.store.cache import CacheWriteError
from app.store.durable import UnsafeFileError
from tests.factories import (
    RecordingWriter,
    chunk_ids,
    chunk_path,
    document,
    documents,
    last_chunk_path,
    manager,
    open_cache,
    write_chunk_file,
)
from tests.waiting import eventually


async def write_all(cm: CheckpointManager, docs: list[Document], writer: RecordingWriter, start: int = 0) -> None:
    chunks = cm.chunk_index_gen()
    for position, doc in enumerate(docs):
        chunk_index = next(chunks)
        if position >= start:
            await cm.write_document(doc, 0, chunk_index, writer)


def held_fsyncs(cm: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """The manager's fsyncs wait, from now on, until the event returned is set (a stalled file system)."""
    release = asyncio.Event()
    real_sync = cm._chunk_files._sync.sync

    async def held(*files: Any) -> None:
        await release.wait()
        await real_sync(*files)

    monkeypatch.setattr(cm._chunk_files._sync, "sync", held)
    return release


async def waits_for_its_fsync(cm: CheckpointManager, chunk_index: int, doc_id: str) -> None:
    """Until the write of `doc_id` is appended and waits for its fsync."""
    chunk = lambda: cm._chunks.get(chunk_index)  # noqa: E731
    await eventually(lambda: doc_id in getattr(chunk(), "unsynced", ()), f"{doc_id} was never appended")


def read_last_chunk(root: Path) -> str:
    return Path(last_chunk_path(root)).read_text()


async def test_a_full_chunk_is_published_and_its_working_files_removed(tmp_path: Path, writer: RecordingWriter) -> None:
    cache = await open_cache(tmp_path)
    cm = manager(tmp_path, 3, request_cache=cache)
    for doc in documents(3):
        await cache.store_result(0, doc.id, 0, {"r": doc.id}, payload_hash="h")
    await write_all(cm, documents(4), writer)
    assert writer.closed == ["00000_chunk_0.jsonl"]
    assert writer.files["00000_chunk_0.jsonl"] == ["0", "1", "2"]
    assert cm.last_chunk_index == 0
    assert read_last_chunk(tmp_path) == "0"
    assert not os.path.exists(chunk_path(tmp_path, 0))
    assert chunk_ids(tmp_path, 1) == ["3"]
    assert dict(cm.per_chunk_counts) == {1: 1}
    assert cm.new_completed_chunks == set()
    await cache.flush()
    resumed_cache = await open_cache(tmp_path)
    assert await resumed_cache.get_cached_response("0", 0, payload_hash="h") == (None, None)
    await resumed_cache.close()
    await cache.close()


async def test_last_chunk_index_moves_one_chunk_at_a_time_in_order(tmp_path: Path, writer: RecordingWriter) -> None:
    cm = manager(tmp_path, 2)
    for doc_id in ("4", "5"):
        await cm.write_document(document(doc_id), 0, 2, writer)
    assert cm.last_chunk_index == -1
    assert cm.new_completed_chunks == {2}
    for doc_id in ("0", "1"):
        await cm.write_document(document(doc_id), 0, 0, writer)
    assert cm.last_chunk_index == 0
    for doc_id in ("2", "3"):
        await cm.write_document(document(doc_id), 0, 1, writer)
    assert cm.last_chunk_index == 2
    assert read_last_chunk(tmp_path) == "2"
    assert cm.new_completed_chunks == set()


async def test_completing_a_chunk_published_already_publishes_it_no_second_time(
    tmp_path: Path, writer: RecordingWriter
) -> None:
    # Chunk 2 is full and published while chunk 0 is still open: the job then declares its last chunk 2
    # complete. The chunk stays published; taken back to "ready" it was closed (published) once more.
    cm = manager(tmp_path, 2)
    for doc_id in ("4", "5"):
        await cm.write_document(document(doc_id), 0, 2, writer)
    assert writer.closed == ["00000_chunk_2.jsonl"]
    await cm.cleanup_last_chunk(0, 2)
    assert writer.closed == ["00000_chunk_2.jsonl"]
    assert cm.last_chunk_index == -1
    assert cm.new_completed_chunks == {2}


def test_a_chunk_past_open_stays_where_it_is_when_declared_complete() -> None:
    chunk = Chunk(2)
    chunk.mark_ready()
    chunk.mark_published()
    chunk.mark_ready()  # the job's completion of its last chunk, arriving after the chunk was published
    assert chunk.state is ChunkState.PUBLISHED


async def test_removed_documents_count_towards_the_chunk_but_skip_the_output(
    tmp_path: Path, writer: RecordingWriter
) -> None:
    cm = manager(tmp_path, 2)
    await cm.write_document(document("a", __no_rollouts_remove=True), 0, 0, writer)
    assert chunk_ids(tmp_path, 0) == ["a"]
    await cm.write_document(document("b"), 0, 0, writer)
    assert writer.writes == [("b", 0, 0)]
    assert cm.last_chunk_index == 0


async def test_the_same_id_twice_in_a_chunk_is_written_and_counted_once(
    tmp_path: Path, writer: RecordingWriter
) -> None:
    cm = manager(tmp_path, 3)
    first = await cm.write_document(document("a"), 0, 0, writer)
    again = await cm.write_document(document("a"), 0, 0, writer)
    assert first.written
    assert again.duplicate
    assert again.chunk_count == 1
    assert chunk_ids(tmp_path, 0) == ["a"]
    assert writer.writes == [("a", 0, 0)]
    assert cm.per_chunk_counts[0] == 1


async def test_concurrent_writers_complete_each_chunk_exactly(tmp_path: Path, writer: RecordingWriter) -> None:
    cm = manager(tmp_path, 500)
    gen = cm.chunk_index_gen()
    docs = [(doc, next(gen)) for doc in documents(1005)]
    semaphore = asyncio.Semaphore(64)

    async def one(doc: Document, chunk_index: int) -> None:
        async with semaphore:
            await cm.write_document(doc, 0, chunk_index, writer)

    await asyncio.gather(*(one(doc, ci) for doc, ci in docs))
    await cm.cleanup_last_chunk(0, 2)
    assert [len(writer.files[f"00000_chunk_{i}.jsonl"]) for i in range(3)] == [500, 500, 5]
    assert sorted(int(i) for ids in writer.files.values() for i in ids) == list(range(1005))
    assert read_last_chunk(tmp_path) == "2"
    assert not os.path.exists(tmp_path / "00000")


async def test_writing_to_a_complete_chunk_is_refused(tmp_path: Path, writer: RecordingWriter) -> None:
    cm = manager(tmp_path, 2)
    await write_all(cm, documents(2), writer)
    with pytest.raises(ChunkCompleteError, match="chunk 0 is already complete"):
        await cm.write_document(document("late"), 0, 0, writer)
    assert writer.files["00000_chunk_0.jsonl"] == ["0", "1"]


async def test_a_failed_append_raises_and_is_not_counted(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    cm = manager(tmp_path, 3)
    await cm.write_document(document("a"), 0, 0, writer)
    real_write = os.write

    def disk_full(fd: int, data: bytes | memoryview) -> int:
        if len(data) > 8:
            real_write(fd, bytes(data[:8]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(app.store.durable.os, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        await cm.write_document(document("b"), 0, 0, writer)
    monkeypatch.undo()
    assert cm.per_chunk_counts[0] == 1
    assert writer.writes == [("a", 0, 0)]
    assert chunk_ids(tmp_path, 0) == ["a"]
    # space is back: the retry is a first write, not a duplicate
    assert (await cm.write_document(document("b"), 0, 0, writer)).written
    assert chunk_ids(tmp_path, 0) == ["a", "b"]


async def test_an_output_writer_failure_undoes_the_checkpoint_line(tmp_path: Path) -> None:
    class BrokenWriter(RecordingWriter):
        def write(self, document: Any, rank: int = 0, **kwargs: Any) -> None:
            raise RuntimeError("output bucket unreachable")

    cm = manager(tmp_path, 3)
    with pytest.raises(RuntimeError, match="unreachable"):
        await cm.write_document(document("a"), 0, 0, BrokenWriter())
    assert cm.per_chunk_counts[0] == 0
    assert chunk_ids(tmp_path, 0) == []


async def test_raw_media_bytes_are_rejected_with_a_message_that_says_what_to_do(
    tmp_path: Path, writer: RecordingWriter
) -> None:
    cm = manager(tmp_path, 3)
    doc = Document(text="t", id="img", media=[{"id": "m", "type": 0, "url": "u", "media_bytes": b"\x89PNG"}])
    with pytest.raises(DocumentError, match=r"media\[0\]\.media_bytes holds 4 raw bytes.*base64"):
        await cm.write_document(doc, 0, 0, writer)
    assert writer.writes == []
    assert not os.path.exists(chunk_path(tmp_path, 0))


async def test_base64_media_round_trips_through_a_resume(tmp_path: Path, writer: RecordingWriter) -> None:
    media = [{"id": "m", "type": 0, "url": "u", "media_bytes": "iVBORw0KGgo="}]
    await manager(tmp_path, 3).write_document(Document(text="t", id="img", media=media), 0, 0, writer)
    resumed = RecordingWriter()
    seen: list[Document] = []
    cm = manager(tmp_path, 3, document_factory=lambda d: seen.append(Document.from_dict(d)) or seen[-1])
    await cm.parse_existing_checkpoints(0, resumed)
    assert seen[0].media == media


@pytest.mark.parametrize("bad", [Document(text="t", id=7), Document(text=None, id="x"), {"id": "x"}])  # type: ignore[arg-type]
async def test_malformed_documents_are_rejected_and_nothing_is_written(
    tmp_path: Path, writer: RecordingWriter, bad: Any
) -> None:
    with pytest.raises(DocumentError):
        await manager(tmp_path, 3).write_document(bad, 0, 0, writer)
    assert not os.path.exists(chunk_path(tmp_path, 0))


async def test_documents_with_empty_text_are_checkpointed_and_resumed(tmp_path: Path, writer: RecordingWriter) -> None:
    await manager(tmp_path, 3).write_document(document("empty", text=""), 0, 0, writer)
    skip, processed = await manager(tmp_path, 3).parse_existing_checkpoints(0, RecordingWriter())
    assert (skip, processed) == (0, {"empty"})


async def test_resume_returns_documents_to_skip_and_processed_ids(tmp_path: Path, writer: RecordingWriter) -> None:
    await write_all(manager(tmp_path, 3), documents(8), writer)
    resumed = RecordingWriter()
    cm = manager(tmp_path, 3)
    assert await cm.parse_existing_checkpoints(0, resumed) == (6, {"6", "7"})
    assert resumed.files == {"00000_chunk_2.jsonl": ["6", "7"]}
    assert cm.per_chunk_counts[2] == 2


async def test_torn_last_line_is_dropped_on_resume_and_appends_stay_clean(
    tmp_path: Path, writer: RecordingWriter
) -> None:
    write_chunk_file(tmp_path, 0, ["a", "b"])
    with open(chunk_path(tmp_path, 0), "ab") as f:
        f.write(b'{"text": "half a li')
    cm = manager(tmp_path, 4)
    assert await cm.parse_existing_checkpoints(0, writer) == (0, {"a", "b"})
    await cm.write_document(document("c"), 0, 0, writer)
    assert chunk_ids(tmp_path, 0) == ["a", "b", "c"]


async def test_unreadable_last_chunk_file_is_reported_and_recovered_from(
    tmp_path: Path, writer: RecordingWriter, caplog: pytest.LogCaptureFixture
) -> None:
    os.makedirs(tmp_path / "last_chunk")
    Path(last_chunk_path(tmp_path)).write_text("")
    write_chunk_file(tmp_path, 4, ["12"])
    cm = manager(tmp_path, 3)
    with caplog.at_level(logging.WARNING):
        result = await cm.parse_existing_checkpoints(0, writer)
    assert result == (0, {"12"})
    assert "last_chunk/00000.txt is empty or unreadable" in caplog.text
    # the job carries on and the file is whole again once a chunk completes
    await write_all(cm, documents(3), writer)
    assert read_last_chunk(tmp_path) == "0"


async def test_resume_with_another_records_per_chunk_fails_naming_both_values(
    tmp_path: Path, writer: RecordingWriter
) -> None:
    await write_all(manager(tmp_path, 3), documents(4), writer)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(RecordsPerChunkMismatch, match=r"records_per_chunk=3.*records_per_chunk=5"):
        await manager(tmp_path, 5).parse_existing_checkpoints(0, RecordingWriter())
    with pytest.raises(RecordsPerChunkMismatch):
        await manager(tmp_path, 5).write_document(document("x"), 0, 1, RecordingWriter())
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / META_FILENAME).read_bytes() == b'{"records_per_chunk":3}'


async def test_a_datatrove_dir_with_larger_chunks_than_this_run_is_refused(tmp_path: Path) -> None:
    write_chunk_file(tmp_path, 0, ["a", "b", "c", "d"])
    with pytest.raises(RecordsPerChunkMismatch, match="4 distinct documents but records_per_chunk is 3"):
        await manager(tmp_path, 3).parse_existing_checkpoints(0, RecordingWriter())


async def test_duplicate_id_in_an_unfinished_chunk_never_closes_it_early(tmp_path: Path) -> None:
    # A chunk file as datatrove leaves it after a retried write: "3" twice.
    # datatrove counts 3 lines, publishes chunk 1 without "5" and skips "5" forever.
    await write_all(manager(tmp_path, 3), documents(3), RecordingWriter())
    write_chunk_file(tmp_path, 1, ["3", "3", "4"])
    writer = RecordingWriter()
    cm = manager(tmp_path, 3)
    assert await cm.parse_existing_checkpoints(0, writer) == (3, {"3", "4"})
    assert writer.closed == []
    await cm.write_document(document("5"), 0, 1, writer)
    assert writer.files["00000_chunk_1.jsonl"] == ["3", "4", "5"]
    assert cm.last_chunk_index == 1


async def test_stale_chunk_files_at_or_below_last_chunk_are_not_replayed(tmp_path: Path) -> None:
    write_chunk_file(tmp_path, 0, ["0", "1"])
    write_chunk_file(tmp_path, 1, ["2"])
    os.makedirs(tmp_path / "last_chunk")
    Path(last_chunk_path(tmp_path)).write_text("0")
    writer = RecordingWriter()
    assert await manager(tmp_path, 2).parse_existing_checkpoints(0, writer) == (2, {"2"})
    assert writer.files == {"00000_chunk_1.jsonl": ["2"]}
    assert not os.path.exists(chunk_path(tmp_path, 0))


async def test_last_chunk_index_never_moves_backwards(tmp_path: Path) -> None:
    cm = manager(tmp_path, 2)
    cm.last_chunk_index = 5
    assert await cm.parse_existing_checkpoints(0, RecordingWriter()) == (12, set())


async def test_cleanup_last_chunk_removes_the_rank_dir_once_reached(tmp_path: Path, writer: RecordingWriter) -> None:
    cache = await open_cache(tmp_path)
    cm = manager(tmp_path, 2, request_cache=cache)
    await write_all(cm, documents(3), writer)
    await cm.cleanup_last_chunk(0, 1)
    assert read_last_chunk(tmp_path) == "1"
    assert not os.path.exists(tmp_path / "00000")
    await cache.close(delete_file=True)
    assert not os.path.exists(tmp_path / "00000")


async def test_cleanup_of_a_chunk_behind_an_incomplete_one_keeps_the_rank_dir(
    tmp_path: Path, writer: RecordingWriter
) -> None:
    cm = manager(tmp_path, 2)
    await cm.write_document(document("0"), 0, 0, writer)
    await cm.write_document(document("2"), 0, 1, writer)
    await cm.cleanup_last_chunk(0, 1)
    assert cm.last_chunk_index == -1
    assert cm.new_completed_chunks == {1}
    assert os.path.exists(chunk_path(tmp_path, 0))


async def test_a_published_chunk_declared_complete_again_is_not_published_twice(
    tmp_path: Path, writer: RecordingWriter
) -> None:
    # Chunk 1 is published while chunk 0 is still open; a job that completes chunk 1 again (a retried
    # POST /chunks/1/complete) leaves it published once, its output whole, when chunk 0 completes after.
    cm = manager(tmp_path, 2)
    await cm.write_document(document("0"), 0, 0, writer)
    await cm.write_document(document("2"), 0, 1, writer)
    await cm.cleanup_last_chunk(0, 1)
    assert writer.closed == ["00000_chunk_1.jsonl"]
    await cm.cleanup_last_chunk(0, 1)
    assert writer.closed == ["00000_chunk_1.jsonl"]
    assert cm.new_completed_chunks == {1}
    await cm.write_document(document("1"), 0, 0, writer)
    assert writer.closed == ["00000_chunk_1.jsonl", "00000_chunk_0.jsonl"]
    assert cm.last_chunk_index == 1
    assert writer.files == {"00000_chunk_0.jsonl": ["0", "1"], "00000_chunk_1.jsonl": ["2"]}


async def test_without_a_checkpoints_dir_documents_only_go_to_the_output(writer: RecordingWriter) -> None:
    cm = CheckpointManager(None, records_per_chunk=2)
    for doc in documents(3):
        await cm.write_document(doc, 0, 0, writer)
    assert writer.writes == [("0", 0, 0), ("1", 0, 0), ("2", 0, 0)]
    assert writer.closed == []
    assert await cm.parse_existing_checkpoints(0, writer) == (0, set())
    await cm.cleanup_last_chunk(0, 0)


def test_constructor_rejects_what_datatrove_rejects() -> None:
    with pytest.raises(ValueError, match="local directory"):
        CheckpointManager("s3://bucket/ckpt")
    with pytest.raises(ValueError, match="records_per_chunk must be positive"):
        CheckpointManager("x", records_per_chunk=0)
    with pytest.raises(ValueError, match="fsync"):
        CheckpointManager("x", fsync="sometimes")  # type: ignore[arg-type]


def test_chunk_index_gen_numbers_positions_by_chunk() -> None:
    gen = CheckpointManager(None, records_per_chunk=2).chunk_index_gen()
    assert [next(gen) for _ in range(5)] == [0, 0, 1, 1, 2]


async def test_fsync_always_syncs_before_returning_and_shares_the_fsync(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)

    cm = manager(tmp_path, 1000)
    await cm.write_document(document("first"), 0, 0, writer)  # creates the file and dirs
    monkeypatch.setattr(app.store.durable.os, "fsync", recording)
    await asyncio.gather(*(cm.write_document(doc, 0, 0, writer) for doc in documents(64)))
    assert 1 <= len(synced) <= 2
    assert synced[-1] == os.path.getsize(chunk_path(tmp_path, 0))


async def test_fsync_never_does_not_sync_chunk_files(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    cm = manager(tmp_path, 1000, fsync="never")
    await cm.write_document(document("first"), 0, 0, writer)
    calls: list[int] = []
    monkeypatch.setattr(app.store.durable.os, "fsync", calls.append)
    await asyncio.gather(*(cm.write_document(doc, 0, 0, writer) for doc in documents(10)))
    assert calls == []
    assert len(chunk_ids(tmp_path, 0)) == 11


async def test_the_final_chunk_is_published_before_last_chunk_moves(tmp_path: Path) -> None:
    # A job killed right after cleanup_last_chunk (before its writer's exit) must not lose its last chunk.
    from app.checkpoints.publish import ChunkPublisher

    cm = manager(tmp_path / "ckpt", 2)
    writer = ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt"))
    await write_all(cm, documents(3), writer)
    await cm.cleanup_last_chunk(0, 1)
    # the process dies here, without leaving any `with` block
    assert sorted(os.listdir(tmp_path / "out")) == ["00000_chunk_0.jsonl", "00000_chunk_1.jsonl"]
    assert (tmp_path / "out" / "00000_chunk_1.jsonl").read_text().count("\n") == 1


async def test_repeated_ids_in_the_input_are_reported_and_the_checkpoint_kept(
    tmp_path: Path, writer: RecordingWriter, caplog: pytest.LogCaptureFixture
) -> None:
    cm = manager(tmp_path, 3)
    with caplog.at_level(logging.WARNING):
        for doc_id, chunk_index in [("a", 0), ("b", 0), ("a", 0), ("c", 1)]:
            await cm.write_document(document(doc_id), 0, chunk_index, writer)
        await cm.cleanup_last_chunk(0, 1)
    assert "document id 'a' was written to chunk 0 again and counted once" in caplog.text
    assert "chunks [0] are incomplete (2 of 3 documents)" in caplog.text
    assert os.path.exists(chunk_path(tmp_path, 0))


async def test_a_last_chunk_far_ahead_is_reported_without_listing_every_chunk_before_it(
    tmp_path: Path, writer: RecordingWriter, caplog: pytest.LogCaptureFixture
) -> None:
    # POST /chunks/{i}/complete takes any i: the warning once listed every chunk before it,
    # a list of 2**62 ints for a hostile i (MemoryError, or the machine's memory).
    cm = manager(tmp_path, 3)
    await cm.write_document(document("a"), 0, 0, writer)
    with caplog.at_level(logging.WARNING):
        await cm.cleanup_last_chunk(0, 10**6)
    [warning] = [r.getMessage() for r in caplog.records if "are incomplete" in r.getMessage()]
    assert "chunks [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ...] are incomplete (1, 0, 0, 0" in warning
    assert len(warning) < 1000
    assert cm.new_completed_chunks == {10**6}


async def test_a_failed_fsync_stops_the_manager_until_a_restart(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    cm = manager(tmp_path, 10)
    await cm.write_document(document("a"), 0, 0, writer)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(app.store.durable.os, "fsync", eio)
    with pytest.raises(OSError, match="could not be made durable"):
        await cm.write_document(document("b"), 0, 0, writer)
    monkeypatch.undo()
    with pytest.raises(OSError, match="Restart the job"):
        await cm.write_document(document("c"), 0, 0, writer)
    assert await manager(tmp_path, 10).parse_existing_checkpoints(0, RecordingWriter()) == (0, {"a", "b"})


@pytest.mark.parametrize("second", ["x", "y"], ids=["a-retry-of-the-failed-write", "a-new-document"])
async def test_a_write_whose_fsync_round_follows_a_failed_one_is_refused_too(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    """Linux reports a writeback error to one fsync: the next round's succeeds, though the pages of the first
    round (the retried document's among them) may be lost. A write waiting for that round is not acknowledged."""
    cm = manager(tmp_path, 10)
    await cm.write_document(document("a"), 0, 0, writer)
    real_fsync, entered, release = os.fsync, threading.Event(), threading.Event()
    calls = 0

    def fsync(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            entered.set()
            release.wait(10)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(app.store.durable.os, "fsync", fsync)
    first = asyncio.create_task(cm.write_document(document("x"), 0, 0, writer))
    await asyncio.to_thread(entered.wait, 10)
    following = asyncio.create_task(cm.write_document(document(second), 0, 0, writer))
    await eventually(lambda: cm._chunk_files._sync._waiters, "the write never waited for the next fsync round")
    release.set()
    with pytest.raises(OSError, match="could not be made durable"):
        await first
    with pytest.raises(OSError, match="could not be made durable"):
        await following
    assert calls == 1  # no second fsync was taken for an answer


async def test_a_chunk_file_whose_folder_fsync_failed_is_made_again_by_the_retry(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were the file left in place, the retry would find it and append to it with its name never made durable."""
    cm = manager(tmp_path, 10)
    rank_dir = os.path.dirname(chunk_path(tmp_path, 0))
    real, synced, failures = app.checkpoints.chunkfiles.fsync_dir, [], [OSError(errno.EIO, "Input/output error")]

    def fsync_dir(path: str) -> None:
        if failures and os.path.abspath(path) == rank_dir:
            raise failures.pop()
        synced.append(os.path.abspath(path))
        real(path)

    monkeypatch.setattr(app.checkpoints.chunkfiles, "fsync_dir", fsync_dir)
    with pytest.raises(OSError, match="Input/output error"):
        await cm.write_document(document("a"), 0, 0, writer)
    assert not os.path.exists(chunk_path(tmp_path, 0))
    assert (await cm.write_document(document("a"), 0, 0, writer)).written == 1
    assert synced == [rank_dir]
    assert chunk_ids(tmp_path, 0) == ["a"]


async def test_resume_never_lists_a_document_whose_fsync_has_not_returned(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume waits a while for the writes under way (`writes_settled`), not for ever: a stalled file system
    outlasts it. A document listed is skipped by the job, so it must be on disk whatever crashes next."""
    cm = manager(tmp_path, 10)
    await cm.write_document(document("a"), 0, 0, writer)
    stalled = held_fsyncs(cm, monkeypatch)
    write = asyncio.create_task(cm.write_document(document("x"), 0, 0, writer))
    await waits_for_its_fsync(cm, 0, "x")
    await cm.writes_settled(0.05)
    assert cm.resume_state() == (0, ["a"])
    stalled.set()
    await write
    assert cm.resume_state() == (0, ["a", "x"])


async def test_a_write_cancelled_before_its_fsync_is_listed_once_a_later_write_is_durable(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    cm = manager(tmp_path, 10)
    release = held_fsyncs(cm, monkeypatch)
    cancelled = asyncio.create_task(cm.write_document(document("a"), 0, 0, writer))
    await waits_for_its_fsync(cm, 0, "a")
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert cm.resume_state() == (0, [])
    release.set()
    await cm.write_document(document("b"), 0, 0, writer)
    assert cm.resume_state() == (0, ["a", "b"])


class CacheRefusingOnce:
    """A request cache whose first `drop_chunk` fails as a full disk makes it fail."""

    def __init__(self) -> None:
        self.dropped: list[int] = []
        self.refused = False

    async def drop_chunk(self, chunk_index: int) -> None:
        if not self.refused:
            self.refused = True
            raise CacheWriteError("could not commit 0 cache entries: database or disk is full")
        self.dropped.append(chunk_index)


class OutputFailingOnce(RecordingWriter):
    """An output writer whose first close raises what nobody foresaw."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def close_file(self, original_name: str) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("an unforeseen bug")
        super().close_file(original_name)


async def test_the_background_publisher_outlives_a_refused_cache_drop_and_an_unforeseen_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Either used to end the publisher for good: past max_waiting_chunks every write was then refused (503)
    until a resume or a completion came, and the rank was never idle."""
    writer, cache = OutputFailingOnce(), CacheRefusingOnce()
    cm = manager(
        tmp_path, 1, request_cache=cache, publish_in_background=True, max_waiting_chunks=1,
        backlog_wait_s=5, retry_backoff_s=0.01, max_retry_backoff_s=0.01,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="app.checkpoints.manager"):
        await cm.write_document(document("a"), 0, 0, writer)  # its publication fails, then its cache drop
        await eventually(lambda: cm.last_chunk_index == 0, "the publisher stopped at the unforeseen error")
        await cm.write_document(document("b"), 0, 1, writer)  # taken: the publisher is there for it
        await cm.write_document(document("c"), 0, 2, writer)
        await eventually(lambda: cm.last_chunk_index == 2, "the publisher stopped at the cache's refusal")
    assert writer.closed == [f"00000_chunk_{index}.jsonl" for index in range(3)]
    assert "an unforeseen bug" in caplog.text
    assert "chunk 0 is published, its cached answers not dropped yet" in caplog.text
    assert cache.dropped == [1, 2]
    assert cm.publication_failure is None
    await cm.close()


async def test_a_completing_write_cancelled_while_it_waits_for_fsync_still_completes_the_chunk(
    tmp_path: Path, writer: RecordingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    cm = manager(tmp_path, 2)
    await cm.write_document(document("a"), 0, 0, writer)
    release = held_fsyncs(cm, monkeypatch)
    completing = asyncio.create_task(cm.write_document(document("b"), 0, 0, writer))
    await waits_for_its_fsync(cm, 0, "b")
    completing.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await completing
    await cm.write_document(document("c"), 0, 1, writer)  # the next write publishes what is ready
    assert cm.last_chunk_index == 0
    assert writer.closed == ["00000_chunk_0.jsonl"]


async def test_without_a_checkpoints_dir_repeated_ids_all_reach_the_output(writer: RecordingWriter) -> None:
    cm = CheckpointManager(None, records_per_chunk=2)
    for _ in range(3):
        await cm.write_document(document("same"), 0, 0, writer)
    assert [w[0] for w in writer.writes] == ["same"] * 3
    assert {index: chunk.ids for index, chunk in cm._chunks.items()} == {0: set()}  # counted, no id kept


@pytest.mark.parametrize("line", [b'{"text": "no id"}\n', b"[1, 2]\n", b'{"id": 7}\n'])
async def test_a_chunk_line_that_is_not_a_document_is_named_with_its_file(tmp_path: Path, line: bytes) -> None:
    write_chunk_file(tmp_path, 0, ["a"])
    with open(chunk_path(tmp_path, 0), "ab") as f:
        f.write(line)
    with pytest.raises(ValueError, match=r"chunk_00000.jsonl: record 2 is not a document"):
        await manager(tmp_path, 3).parse_existing_checkpoints(0, RecordingWriter())


async def test_a_corrupt_meta_file_says_how_to_repair_it(tmp_path: Path) -> None:
    (tmp_path / META_FILENAME).write_text("{not json")
    with pytest.raises(ValueError, match=r"checkpoint_meta.json is not a JSON object with records_per_chunk"):
        await manager(tmp_path, 3).parse_existing_checkpoints(0, RecordingWriter())


async def test_a_meta_file_that_is_a_link_or_a_fifo_is_refused_unread(tmp_path: Path) -> None:
    meta = tmp_path / META_FILENAME
    (tmp_path / "elsewhere.json").write_text('{"records_per_chunk": 3}')
    meta.symlink_to(tmp_path / "elsewhere.json")  # to /dev/zero, read whole: memory filled in seconds
    with pytest.raises(UnsafeFileError, match=rf"^{meta} is a symbolic link, not a regular file"):
        await manager(tmp_path, 3).parse_existing_checkpoints(0, RecordingWriter())
    meta.unlink()
    os.mkfifo(meta)  # opened for reading: blocked for ever
    with pytest.raises(UnsafeFileError, match=rf"^{meta} is a FIFO, not a regular file"):
        await manager(tmp_path, 3).parse_existing_checkpoints(0, RecordingWriter())


def test_remaining_is_datatrove_resume_loop() -> None:
    cm = CheckpointManager(None, records_per_chunk=3)
    todo, last_chunk = cm.remaining(documents(8), 3, {"4", "6"})
    assert [(doc.id, chunk) for doc, chunk in todo] == [("3", 1), ("5", 1), ("7", 2)]
    assert last_chunk == 2
    assert cm.remaining([], 0, set()) == ([], -1)

"""The batch engine (contract §12) where its disk refuses a save, and where proxies share its folder: a status is
shown only once it is kept, a batch whose save was refused carries on once the disk takes it, and a batch is
written by the proxy holding its lock only."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from app.service.batches import engine as engine_module
from app.service.batches.engine import BatchEngine
from app.service.coalescing import Flights
from app.service.settings import Settings
from app.service.upstream import UpstreamPool
from app.store.batches import BatchDir, BatchRecord
from app.store.cache import count_rows
from app.store.durable import UnsafeFileError
from app.store.files import FileStore, FileWriter
from tests.servers import fake_upstream
from tests.service.test_batches import CHAT, batch_settings, chat_line, put_file
from tests.waiting import eventually


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return batch_settings(tmp_path, batch_retries=0)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "DISK_RETRY_S", 0.05)
    monkeypatch.setattr(engine_module, "SAVE_EVERY_S", 0.05)


@asynccontextmanager
async def engine_on(settings: Settings, url: str, inflight: int = 4) -> AsyncIterator[BatchEngine]:
    """A proxy's batch engine on `settings.checkpoints_dir` (two of them share it as two proxies would)."""
    pool = UpstreamPool([url], max_inflight=inflight)
    await pool.start()
    files = FileStore(settings.checkpoints_dir / "files")
    files.open()
    ours = settings.model_copy(update={"max_inflight_per_upstream": inflight, "upstream": [url]})
    engine = BatchEngine(ours, pool, Flights(), files, str(settings.checkpoints_dir / "batches"))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()
        await pool.close()


def refuse_saves(monkeypatch: pytest.MonkeyPatch, when: Callable[[BatchRecord], bool]) -> list[str]:
    """`BatchDir.save` refuses, once, the first record `when` picks, as a full disk does; then has room again."""
    real = BatchDir.save
    refused: list[str] = []

    def save(self: BatchDir, record: BatchRecord) -> None:
        if not refused and when(record):
            refused.append(record.status)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, record)

    monkeypatch.setattr(BatchDir, "save", save)
    return refused


def on_disk(settings: Settings, batch_id: str) -> BatchRecord:
    return BatchDir(settings.checkpoints_dir / "batches" / batch_id).load()


def lines(n: int) -> list[dict[str, object]]:
    return [chat_line(f"k{i}", f"q{i}") for i in range(n)]


@pytest.mark.parametrize(
    ("refused_status", "input_lines", "ends"),
    [
        ("in_progress", 5, "completed"),  # validation's end: the batch once stalled, no line ever sent
        ("failed", 0, "failed"),  # a bad input's: GET said `validating` for ever
        ("completed", 5, "completed"),  # finalizing's last save: `finalizing` for ever, /stats said completed
    ],
)
async def test_a_status_change_the_disk_refused_once_is_made_when_it_has_room(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, refused_status: str, input_lines: int, ends: str
) -> None:
    refused = refuse_saves(monkeypatch, lambda r: r.status == refused_status)
    async with fake_upstream() as (url, upstream):
        file_id = put_file(settings.checkpoints_dir, lines(input_lines), raw=None if input_lines else b"not json\n")
        async with engine_on(settings, url) as engine:
            record = await engine.create(file_id, CHAT, "24h", None)
            await eventually(lambda: record.id not in engine.running, f"batch stuck {engine.get(record.id).status}")
            assert refused == [refused_status]
            assert engine.get(record.id).status == on_disk(settings, record.id).status == ends
            assert engine.ended[record.id] == ends
            assert upstream.generations == input_lines


async def test_a_cancel_the_disk_refused_is_neither_shown_nor_half_done_and_its_retry_stops_the_batch(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was shown `cancelling` while every line went on being sent; the retry, seeing `cancelling`, did nothing."""
    refused = refuse_saves(monkeypatch, lambda r: r.status == "cancelling")
    async with fake_upstream(latency_ms=50) as (url, upstream):
        file_id = put_file(settings.checkpoints_dir, lines(200))
        async with engine_on(settings, url, inflight=2) as engine:
            record = await engine.create(file_id, CHAT, "24h", None)
            await eventually(lambda: engine.get(record.id).completed >= 4, "no line was answered")
            with pytest.raises(OSError, match="No space left"):
                await engine.cancel(record.id)
            assert refused == ["cancelling"]
            assert engine.get(record.id).status == on_disk(settings, record.id).status == "in_progress"
            assert (await engine.cancel(record.id)).status == "cancelling"  # the client's retry
            await eventually(lambda: record.id not in engine.running, "the cancelled batch never ended")
            assert engine.get(record.id).status == "cancelled"
            assert upstream.requests < 200


async def test_a_cancel_through_another_proxy_shows_at_once_through_the_one_running_the_batch(
    settings: Settings,
) -> None:
    async with fake_upstream(latency_ms=100) as (url, _):
        file_id = put_file(settings.checkpoints_dir, lines(400))
        async with engine_on(settings, url, inflight=2) as owner, engine_on(settings, url, inflight=2) as other:
            record = await owner.create(file_id, CHAT, "24h", None)
            await eventually(lambda: owner.get(record.id).completed >= 2, "no line was answered")
            assert (await other.cancel(record.id)).status == "cancelling"
            assert owner.get(record.id).status == "cancelling"  # was `in_progress` until its next save
            await eventually(lambda: record.id not in owner.running, "the cancelled batch never ended")
            assert owner.get(record.id).status == other.get(record.id).status == "cancelled"


async def test_a_proxy_looking_for_batches_to_carry_on_never_takes_one_being_created(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record was written before the creator took the batch's lock: another proxy's adopt in between took
    it and ran it, and the creator answered 500 for a batch that ran (a client retrying paid twice)."""
    async with fake_upstream() as (url, upstream):
        file_id = put_file(settings.checkpoints_dir, lines(5))
        async with engine_on(settings, url) as creator, engine_on(settings, url) as other:
            loop, real_save = asyncio.get_running_loop(), BatchDir.save

            def save(self: BatchDir, record: BatchRecord) -> None:
                real_save(self, record)
                if record.status == "validating":  # the other's adopt (every ADOPT_EVERY_S) lands here
                    asyncio.run_coroutine_threadsafe(other.adopt(), loop).result()

            monkeypatch.setattr(BatchDir, "save", save)
            record = await creator.create(file_id, CHAT, "24h", None)
            monkeypatch.setattr(BatchDir, "save", real_save)
            assert list(other.running) == []
            await eventually(lambda: record.id not in creator.running, "the batch never ended")
            assert creator.get(record.id).status == "completed"
            assert upstream.generations == 5


async def test_a_stopping_proxy_lets_a_batch_go_only_once_its_output_file_is_written(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write went on in its thread after the lock was let go: the proxy taking the batch over wrote the same
    reserved file id, and the first writer's failed commit then deleted the second's bytes."""
    slow_stores: set[int] = set()  # the first proxy's: a large output file, slow to write
    writing, written = threading.Event(), threading.Event()
    real_write, real_commit = FileWriter.write, FileStore.commit

    def write(self: FileWriter, data: bytes) -> None:
        if id(self._store) in slow_stores:
            writing.set()
            time.sleep(0.5)
        real_write(self, data)

    def commit(self: FileStore, writer: FileWriter) -> object:
        try:
            return real_commit(self, writer)
        finally:
            if id(self) in slow_stores:
                written.set()

    monkeypatch.setattr(FileWriter, "write", write)
    monkeypatch.setattr(FileStore, "commit", commit)
    async with fake_upstream() as (url, _):
        file_id = put_file(settings.checkpoints_dir, lines(300))
        async with engine_on(settings, url, inflight=64) as first:
            slow_stores.add(id(first.files))
            record = await first.create(file_id, CHAT, "24h", None)
            await eventually(writing.is_set, "the first proxy never began its output file")
            first.stop_sending()
            first._stopping_since = time.monotonic() - 60  # SIGTERM, the live requests' grace spent
            await first.close()
            assert written.is_set()  # before the lock was let go
            async with engine_on(settings, url, inflight=64) as second:
                await eventually(lambda: second.get(record.id).status == "completed", "never taken over")
    final = on_disk(settings, record.id)
    output = settings.checkpoints_dir / "files" / str(final.output_file_id)
    assert len(output.read_bytes().splitlines()) == 300


async def test_a_forgotten_name_past_64_bits_does_not_stop_the_answers_cache_from_keeping_answers(
    settings: Settings,
) -> None:
    # Anyone who can write in a shared checkpoints dir could plant it: 20 digits passed `isdigit`, and SQLite
    # refused the int at every commit of the drop, which stayed queued with every answer stored after it.
    forgotten = settings.checkpoints_dir / "batches" / "answers" / "forgotten"
    forgotten.mkdir(parents=True)
    for name in ("9" * 20, str(2**62), "-1", "\u0661\u0662"):
        (forgotten / name).write_bytes(b"")
    async with fake_upstream() as (url, _):
        file_id = put_file(settings.checkpoints_dir, lines(3))
        async with engine_on(settings, url) as engine:
            record = await engine.create(file_id, CHAT, "24h", None)
            await eventually(lambda: record.id not in engine.running, "the batch never ended")
            assert engine.get(record.id).status == "completed"
            db = engine.answers.db_path
            assert db is not None
            await eventually(lambda: count_rows(db) == 3, "the batch's answers were never committed", timeout_s=5)


@pytest.mark.parametrize("planted", ["file", "link"])
async def test_a_forgotten_folder_planted_as_a_file_or_link_stops_nothing_and_is_never_written_through(
    settings: Settings, tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A file there failed the engine's start (NotADirectoryError), and every look for batches to carry on
    # after; a link was written through at each deletion (contract §9: never through a link planted there).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    answers = settings.checkpoints_dir / "batches" / "answers"
    answers.mkdir(parents=True)
    if planted == "file":
        (answers / "forgotten").write_bytes(b"")
    else:
        (answers / "forgotten").symlink_to(elsewhere)
    async with fake_upstream() as (url, _):
        file_id = put_file(settings.checkpoints_dir, lines(3))
        async with engine_on(settings, url) as engine:
            record = await engine.create(file_id, CHAT, "24h", None)
            await eventually(lambda: record.id not in engine.running, "the batch never ended")
            output = engine.get(record.id).output_file_id
            assert output is not None
            with pytest.raises(UnsafeFileError):
                await engine.forget_output(output)  # and so the file is not deleted (the route's 503)
    assert list(elsewhere.iterdir()) == []
    said = [r.getMessage() for r in caplog.records if "whose output was deleted cannot be read" in r.getMessage()]
    assert len(said) == 1

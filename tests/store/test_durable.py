from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

import app.store.durable
from app.store.durable import (
    AppendFile,
    CorruptFileError,
    GroupSync,
    UnsafeFileError,
    atomic_write_bytes,
    create_exclusive_bytes,
    is_disk_full,
    make_dirs_durable,
    read_jsonl_repairing_tail,
    read_jsonl_whole_lines,
    read_regular,
    refusal_reason,
    scan_jsonl,
)
from tests import faults


@pytest.mark.parametrize(
    ("refusal", "full", "reason"),
    [
        (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/f"), True, os.strerror(errno.ENOSPC)),
        (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), True, os.strerror(errno.EDQUOT)),
        (faults.sqlite_full(), True, "database or disk is full"),
        (faults.sqlite_shm_not_grown(), True, "disk I/O error"),
        (OSError(errno.EIO, os.strerror(errno.EIO)), False, os.strerror(errno.EIO)),
        (UnsafeFileError("/ckpt/f is a symbolic link"), False, "/ckpt/f is a symbolic link"),
        (faults.sqlite_read_only(), False, "attempt to write a readonly database"),
    ],
    ids=["ENOSPC", "EDQUOT", "SQLITE_FULL", "SQLITE_IOERR_SHMSIZE", "EIO", "unsafe", "SQLITE_READONLY"],
)
def test_a_full_disk_is_told_from_other_refusals_in_the_system_s_words_and_sqlite_s(
    refusal: OSError | sqlite3.Error, full: bool, reason: str
) -> None:
    assert is_disk_full(refusal) is full
    assert refusal_reason(refusal) == reason


def test_an_error_caused_by_a_full_disk_is_not_one_itself() -> None:
    # A failed fsync on a full disk breaks a rank for good: freeing space does not mend it.
    wrapper = OSError("a checkpoint file could not be made durable earlier")
    wrapper.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert not is_disk_full(wrapper)
    assert not is_disk_full(None)


def test_append_that_fails_mid_line_leaves_the_file_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.jsonl"
    file = AppendFile(str(path))
    file.append(b'{"id":"a"}\n')
    real_write = os.write

    def half_then_enospc(fd: int, data: bytes | memoryview) -> int:
        if len(data) > 4:
            return real_write(fd, bytes(data[:4]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(app.store.durable.os, "write", half_then_enospc)
    with pytest.raises(OSError, match="No space left"):
        file.append(b'{"id":"b"}\n')
    monkeypatch.undo()
    assert path.read_bytes() == b'{"id":"a"}\n'
    file.append(b'{"id":"c"}\n')
    file.close()
    assert path.read_bytes() == b'{"id":"a"}\n{"id":"c"}\n'


def test_append_file_reopened_continues_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x\n")
    file = AppendFile(str(path))
    assert file.size == 2
    assert file.append(b"y\n") == 2
    file.close()
    file.close()  # idempotent
    assert file.closed


def test_atomic_write_replaces_the_content_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "last.txt"
    atomic_write_bytes(str(path), b"1")
    atomic_write_bytes(str(path), b"2")
    assert path.read_bytes() == b"2"
    assert os.listdir(path.parent) == ["last.txt"]


def test_atomic_write_that_fails_keeps_the_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.txt"
    atomic_write_bytes(str(path), b"7")

    def crash(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "simulated crash before rename")

    monkeypatch.setattr(app.store.durable.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        atomic_write_bytes(str(path), b"8")
    assert path.read_bytes() == b"7"
    assert os.listdir(tmp_path) == ["last.txt"]


async def test_concurrent_writers_share_one_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fsyncs = 0
    real_fsync = os.fsync

    def counting(fd: int) -> None:
        nonlocal fsyncs
        fsyncs += 1
        real_fsync(fd)

    monkeypatch.setattr(app.store.durable.os, "fsync", counting)
    file = AppendFile(str(tmp_path / "f"))
    group = GroupSync()

    async def writer(i: int) -> None:
        file.append(f"{i}\n".encode())
        await group.sync(file)

    await asyncio.gather(*(writer(i) for i in range(64)))
    file.close()
    # all 64 arrive before the first fsync starts: one round serves them all
    assert fsyncs == 1


async def test_a_writer_waits_for_an_fsync_that_started_after_its_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = GroupSync()
    file = AppendFile(str(tmp_path / "f"))
    synced_sizes: list[int] = []
    real_fsync = os.fsync

    def recording(fd: int) -> None:
        synced_sizes.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(app.store.durable.os, "fsync", recording)
    file.append(b"first\n")
    first = asyncio.create_task(group.sync(file))
    await asyncio.sleep(0)  # the first round starts
    file.append(b"second\n")
    await group.sync(file)
    await first
    file.close()
    assert synced_sizes[-1] == len(b"first\nsecond\n")


async def test_fsync_error_reaches_every_waiter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(app.store.durable.os, "fsync", failing)
    group = GroupSync()
    file = AppendFile(str(tmp_path / "f"))
    results = await asyncio.gather(*(group.sync(file) for _ in range(3)), return_exceptions=True)
    file.close()
    assert all(isinstance(r, OSError) for r in results)


async def test_after_a_failed_fsync_every_later_sync_fails_though_the_kernel_reports_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def once(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(app.store.durable.os, "fsync", once)
    group = GroupSync()
    file = AppendFile(str(tmp_path / "f"))
    with pytest.raises(OSError, match="I/O error"):
        await group.sync(file)
    file.append(b"later\n")
    with pytest.raises(OSError, match=r"an earlier fsync of these files failed \(\[Errno 5\] I/O error\)"):
        await group.sync(file)
    file.close()
    assert len(calls) == 1
    assert isinstance(group.failed, OSError)
    assert group.failed.errno == errno.EIO


def test_a_folder_whose_parent_fsync_failed_is_removed_so_that_a_retry_makes_it_durably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, synced = app.store.durable.fsync_dir, []
    failures = [OSError(errno.EIO, "I/O error")]

    def fsync_dir(path: str) -> None:
        if failures:
            raise failures.pop()
        synced.append(path)
        real(path)

    monkeypatch.setattr(app.store.durable, "fsync_dir", fsync_dir)
    with pytest.raises(OSError, match="I/O error"):
        make_dirs_durable(str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    make_dirs_durable(str(tmp_path / "a" / "b"))
    assert synced == [str(tmp_path), str(tmp_path / "a")]


def test_a_file_where_a_folder_should_be_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("a file")
    with pytest.raises(NotADirectoryError):
        make_dirs_durable(str(tmp_path / "out"))
    with pytest.raises(NotADirectoryError):
        atomic_write_bytes(str(tmp_path / "out" / "f"), b"x", under=str(tmp_path / "out"))


def test_a_write_under_a_folder_that_is_gone_makes_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="the folder is gone"):
        atomic_write_bytes(str(tmp_path / "out" / "rank" / "f"), b"x", under=str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "out").mkdir()
    atomic_write_bytes(str(tmp_path / "out" / "rank" / "f"), b"x", under=str(tmp_path / "out"))
    assert (tmp_path / "out" / "rank" / "f").read_bytes() == b"x"


@pytest.mark.parametrize(
    "tail",
    [b'{"id":"c","te', b'{"id":"c"}', b"\0\0\0\0", b'{"id":"c"\0\0\n'],
    ids=["half-line", "no-newline", "nul-bytes", "garbage-line"],
)
def test_torn_last_line_is_dropped_and_the_file_cut_back(tmp_path: Path, tail: bytes) -> None:
    path = tmp_path / "chunk.jsonl"
    whole = b'{"id":"a"}\n{"id":"b"}\n'
    path.write_bytes(whole + tail)
    assert read_jsonl_repairing_tail(str(path)) == [{"id": "a"}, {"id": "b"}]
    assert path.read_bytes() == whole


def test_blank_lines_are_skipped_and_a_whole_file_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "chunk.jsonl"
    path.write_bytes(b'{"id":"a"}\n\n{"id":"b"}\n')
    assert read_jsonl_repairing_tail(str(path)) == [{"id": "a"}, {"id": "b"}]
    assert path.read_bytes() == b'{"id":"a"}\n\n{"id":"b"}\n'


def test_a_bad_line_followed_by_good_ones_is_corruption_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "chunk.jsonl"
    content = b'{"id":"a"}\n{"id":\n{"id":"b"}\n'
    path.write_bytes(content)
    with pytest.raises(CorruptFileError, match=r"chunk.jsonl: line 2 is not valid JSON"):
        read_jsonl_repairing_tail(str(path))
    assert path.read_bytes() == content


def test_a_replaced_file_is_readable_as_a_new_file_would_be(tmp_path: Path) -> None:
    # mkstemp made every published chunk 0600: other users and downstream jobs could not read it.
    previous = os.umask(0o022)
    try:
        atomic_write_bytes(str(tmp_path / "chunk.jsonl"), b"{}\n")
        os.umask(0o027)
        atomic_write_bytes(str(tmp_path / "other.jsonl"), b"{}\n")
    finally:
        os.umask(previous)
    assert (tmp_path / "chunk.jsonl").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "other.jsonl").stat().st_mode & 0o777 == 0o640


def test_an_exclusive_create_never_replaces_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    create_exclusive_bytes(str(tmp_path / "meta.json"), b"first")
    with pytest.raises(FileExistsError):
        create_exclusive_bytes(str(tmp_path / "meta.json"), b"second")
    assert (tmp_path / "meta.json").read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["meta.json"]


OPENERS: dict[str, Callable[[str], object]] = {
    "repair": read_jsonl_repairing_tail,
    "scan": scan_jsonl,
    "read": read_jsonl_whole_lines,
    "append": lambda path: AppendFile(path).append(b'{"id":"x"}\n'),
}


@pytest.mark.parametrize("opener", OPENERS.values(), ids=OPENERS.keys())
def test_a_chunk_file_that_is_a_link_is_refused_and_the_file_it_points_to_left_alone(
    tmp_path: Path, opener: Callable[[str], object]
) -> None:
    # Anyone who could write in a shared checkpoints dir made a root proxy cut any file: the victim,
    # whose last line has no newline, read as a torn append and was truncated to nothing.
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious, without a newline")
    link = tmp_path / "chunk_00001.jsonl"
    link.symlink_to(victim)
    with pytest.raises(UnsafeFileError, match=rf"^{link} is a symbolic link, not a regular file: .* Remove it"):
        opener(str(link))
    assert victim.read_bytes() == b"precious, without a newline"
    assert link.is_symlink()


@pytest.mark.parametrize("opener", OPENERS.values(), ids=OPENERS.keys())
def test_a_fifo_or_a_folder_named_as_a_chunk_file_is_refused_without_opening_it(
    tmp_path: Path, opener: Callable[[str], object]
) -> None:
    fifo = tmp_path / "chunk_00001.jsonl"
    os.mkfifo(fifo)  # opened, it blocked the reader until some writer came (never)
    with pytest.raises(UnsafeFileError, match=rf"^{fifo} is a FIFO, not a regular file"):
        opener(str(fifo))
    folder = tmp_path / "chunk_00002.jsonl"
    folder.mkdir()
    with pytest.raises(UnsafeFileError, match=rf"^{folder} is a folder, not a regular file"):
        opener(str(folder))


def test_a_small_file_is_read_up_to_its_bound_and_no_further(tmp_path: Path) -> None:
    path = tmp_path / "00000.txt"
    path.write_bytes(b"7" * 10)
    assert read_regular(str(path), limit=10) == b"7" * 10
    with pytest.raises(ValueError, match="more than 9 bytes"):
        read_regular(str(path), limit=9)


def test_an_atomic_write_over_a_link_replaces_the_link_and_never_writes_through_it(tmp_path: Path) -> None:
    # Replaced by a rename, which acts on the name: the link goes, what it pointed to stays as it was.
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    link = tmp_path / "last_chunk" / "00007.txt"
    link.parent.mkdir()
    link.symlink_to(victim)
    atomic_write_bytes(str(link), b"3")
    assert not link.is_symlink()
    assert link.read_bytes() == b"3"
    assert victim.read_bytes() == b"precious"

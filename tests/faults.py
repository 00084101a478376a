"""Faults tests inject: a crash at a chosen step, a disk that really fills up, SQLite refusing a write."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

#: The steps of chunk completion at which `CheckpointManager`'s `fault` hook is called, in order.
CHUNK_COMPLETION_STEPS = ("output_closed", "last_chunk_written", "chunk_file_deleted", "cache_rows_dropped")


class SimulatedCrash(BaseException):
    """A BaseException, like the process dying: no `except Exception` swallows it."""


@contextlib.contextmanager
def small_disk(where: Path, size: str = "1m", *, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` (created): a disk that really fills up, or with `read_only`
    one mounted read-only (EROFS). Needs root, as CI and developers run here."""
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill_disk(disk: Path, leave: int = 0) -> Path:
    """Fill the file system of `disk` with one file, leaving about `leave` bytes free; return the file
    (remove it to give the space back)."""
    filler = disk / "filler"
    stat = os.statvfs(disk)
    # Unbuffered: others write to the disk meanwhile, and what does not fit must not wait in a buffer
    # for the close to fail on it.
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):  # ENOSPC: full
        f.write(b"\0" * max(stat.f_bavail * stat.f_frsize - leave, 0))
    return filler


def sqlite_full() -> sqlite3.OperationalError:
    """The error SQLite gives a write on a full disk (SQLITE_FULL, "database or disk is full"), raised by
    SQLite itself: a database past its `max_page_count` is refused alike."""
    return _refused_by_sqlite(":memory:", "PRAGMA max_page_count = 1")


def sqlite_shm_not_grown() -> sqlite3.OperationalError:
    """The error SQLite gives when it cannot grow a WAL index (`-shm`) on a full disk (SQLITE_IOERR_SHMSIZE),
    as SQLite words it: only a full disk makes it, which tests/e2e/test_disk_full.py fills for real."""
    error = sqlite3.OperationalError("disk I/O error")
    error.sqlite_errorcode = sqlite3.SQLITE_IOERR_SHMSIZE  # type: ignore[attr-defined]
    error.sqlite_errorname = "SQLITE_IOERR_SHMSIZE"  # type: ignore[attr-defined]
    return error


def sqlite_read_only() -> sqlite3.OperationalError:
    """The error SQLite gives a write to a read-only database (SQLITE_READONLY), raised by SQLite itself."""
    return _refused_by_sqlite("file::memory:?mode=ro")


def _refused_by_sqlite(database: str, *setup: str) -> sqlite3.OperationalError:
    conn = sqlite3.connect(database, uri=True)
    try:
        for statement in setup:
            conn.execute(statement)
        conn.execute("CREATE TABLE refused (x)")
    except sqlite3.OperationalError as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError(f"SQLite wrote to {database} after {setup}")

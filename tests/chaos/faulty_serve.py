"""`inferproxy serve ARGS...` with faults injected: `python -m tests.chaos.faulty_serve FAULT LOG ARGS...`.

FAULT is `none` or `STEP@N`: the process kills itself with SIGKILL the N-th time STEP happens.

- a step of chunk completion (`tests.faults.CHUNK_COMPLETION_STEPS`), through `CheckpointManager`'s
  `fault` hook;
- `publish_rename`: a complete chunk written to the output under its temporary name, not yet renamed
  over its own;
- `cache_commit`: a batch of answers inserted into a cache file, its COMMIT not yet run;
- `cache_mid_batch`: the first of a batch's several INSERT statements run, the next not yet;
- `batch_file_bytes`: a Batch API file (a batch's output or error file) with its bytes renamed into place
  under `<checkpoints>/files`, its metadata not written yet (the file does not exist yet);
- `batch_file`: such a file complete, its metadata written (the batch's record not yet saved).

Before it dies it appends one JSON line to LOG: the step, when (`time.monotonic()`: one clock for every
process of the machine), and for a cache step the file and the keys (doc id, rollout) of the batch it cut.

For a power cut (`ProxyProcess.cut_power`), LOG + `.synced` keeps (JSON) the size each chunk file of
the checkpoints dir (and each batch's `results.jsonl`) had when its last fsync began: what a power cut
cannot take from it.

While the file LOG + `.io` exists, holding `ERRNO CALLS DIR` (`EIO fsync,write /data/output`),
`os.write` and `os.fsync` (those of CALLS) on files under DIR fail with that errno (a write after
taking half of its bytes): a disk that fails, switched on and off from outside by writing and
removing that file.

While the file LOG + `.slow` exists, holding `SECONDS DIR`, `os.open` of a path under DIR first sleeps
SECONDS (a slow or starved output filesystem, a node that stalls mid-publish); the file LOG +
`.slowed` is created as such an open begins, LOG + `.slept` once its sleep is over.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import app.service.services
import app.store.files
from app.checkpoints.manager import CheckpointManager
from app.cli import main
from app.store.files import is_file_id
from tests.faults import CHUNK_COMPLETION_STEPS

_INSERT = "INSERT OR REPLACE INTO request_cache"


class FaultLog:
    """The chosen fault: its step, and how many more times that step may happen before the process dies."""

    def __init__(self, path: str, step: str, nth: int) -> None:
        self.path = path
        self.step = step
        self.left = nth

    def happened(self, step: str, **details: Any) -> None:
        """`step` happened: die if it is the chosen one's N-th time."""
        if step != self.step:
            return
        self.left -= 1
        if self.left:
            return
        with open(self.path, "a") as log:
            log.write(json.dumps({"step": step, "at": time.monotonic(), **details}) + "\n")
            log.flush()
            os.fsync(log.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


def faulty_connection(log: FaultLog) -> type[sqlite3.Connection]:
    class FaultyConnection(sqlite3.Connection):
        """Counts the INSERT statements of each transaction and remembers their keys."""

        db_path = ""
        inserted: tuple[tuple[str, int], ...] = ()
        statements = 0

        def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
            if sql == "BEGIN":
                self.inserted, self.statements = (), 0
            elif sql.startswith(_INSERT):
                if self.statements:
                    log.happened("cache_mid_batch", db=self.db_path, keys=self.inserted)
                self.statements += 1
                row = sql.partition("VALUES")[2].partition(")")[0].count("?")  # a row's values: its columns
                self.inserted += tuple((parameters[i + 1], parameters[i + 2]) for i in range(0, len(parameters), row))
            elif sql == "COMMIT" and self.statements:
                log.happened("cache_commit", db=self.db_path, keys=self.inserted)
            return super().execute(sql, parameters)

    return FaultyConnection


def inject(fault: str, log_path: str, output: str, checkpoints: str) -> None:
    step, _, nth = fault.partition("@")
    log = FaultLog(log_path, step, int(nth or 1))
    if step in CHUNK_COMPLETION_STEPS:
        app.service.services.CheckpointManager = functools.partial(CheckpointManager, fault=log.happened)
    elif step == "publish_rename":
        replace = os.replace

        def replacing(src: Any, dst: Any, **kwargs: Any) -> None:
            if str(dst).startswith(output.rstrip(os.sep) + os.sep):
                log.happened(step, target=str(dst))
            replace(src, dst, **kwargs)

        os.replace = replacing
    elif step in ("cache_commit", "cache_mid_batch"):
        connect = sqlite3.connect
        factory = faulty_connection(log)

        def connecting(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = connect(database, *args, factory=factory, **kwargs)
            conn.db_path = str(database)
            return conn

        sqlite3.connect = connecting
    elif step == "batch_file_bytes":
        files = os.path.join(checkpoints, "files") + os.sep
        replace_file = os.replace

        def renaming(src: Any, dst: Any, **kwargs: Any) -> None:
            replace_file(src, dst, **kwargs)
            if str(dst).startswith(files) and is_file_id(os.path.basename(dst)):
                log.happened(step, file=str(dst))

        os.replace = renaming
    elif step == "batch_file":
        write_meta = app.store.files.atomic_write_bytes

        def writing_meta(path: str, data: bytes, **kwargs: Any) -> None:
            write_meta(path, data, **kwargs)
            log.happened(step, file=path)

        app.store.files.atomic_write_bytes = writing_meta
    else:
        raise SystemExit(f"faulty_serve: unknown fault {fault!r}")


def path_of(fd: int) -> str:
    """The path a descriptor is open on (Linux)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def recording_synced_sizes(record: Path, where: str) -> None:
    """`os.fsync` of a chunk file (or a batch's `results.jsonl`) under `where` records the size the file had
    when it began."""
    sizes = json.loads(record.read_text()) if record.exists() else {}
    lock = threading.Lock()  # fsyncs run in threads
    fsync = os.fsync

    def fsyncing(fd: int) -> None:
        path = path_of(fd)
        name = os.path.basename(path)
        chunk_file = path.startswith(where + os.sep) and (name.startswith("chunk_") or name == "results.jsonl")
        size = os.fstat(fd).st_size if chunk_file else None
        fsync(fd)
        if size is not None:
            with lock:
                sizes[path] = size
                record.with_suffix(".tmp").write_text(json.dumps(sizes))
                os.rename(record.with_suffix(".tmp"), record)

    os.fsync = fsyncing


def failing_io(switch: Path) -> None:
    """`os.write` and `os.fsync` fail as the switch file says, while it exists."""

    def failing(real: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(fd: int, *args: Any) -> Any:
            try:
                code, calls, where = switch.read_text().split(maxsplit=2)
            except (FileNotFoundError, ValueError):
                return real(fd, *args)
            if name in calls.split(",") and path_of(fd).startswith(where.rstrip(os.sep) + os.sep):
                if name == "write":  # a failing disk may take part of a write first
                    real(fd, bytes(args[0][: len(args[0]) // 2]))
                number = getattr(errno, code)
                raise OSError(number, f"{os.strerror(number)} (injected into {name})")
            return real(fd, *args)

        return call

    os.write = failing(os.write, "write")
    os.fsync = failing(os.fsync, "fsync")


def slow_io(switch: Path) -> None:
    """`os.open` of a path under the switch's DIR sleeps its SECONDS first, while the switch file exists."""
    real_open = os.open
    slowed = switch.with_suffix(".slowed")

    def opening(path: Any, flags: int, mode: int = 0o777, *args: Any, **kwargs: Any) -> int:
        try:
            seconds, where = switch.read_text().split(maxsplit=1)
        except (FileNotFoundError, ValueError):
            return real_open(path, flags, mode, *args, **kwargs)
        if str(path).startswith(where.rstrip(os.sep) + os.sep):
            slowed.touch()
            time.sleep(float(seconds))
            slowed.with_suffix(".slept").touch()
        return real_open(path, flags, mode, *args, **kwargs)

    os.open = opening


if __name__ == "__main__":
    fault, log_path, *args = sys.argv[1:]
    output = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--output="))
    checkpoints = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--checkpoints-dir="))
    if fault != "none":
        inject(fault, log_path, output, checkpoints)
    recording_synced_sizes(Path(log_path + ".synced"), os.path.realpath(checkpoints))
    failing_io(Path(log_path + ".io"))  # outermost: an fsync that fails records nothing
    slow_io(Path(log_path + ".slow"))
    sys.exit(main(args))

"""OUTPUT: every line's result in input order, written whole or not at all, and the lines the upstream never
answered (after every retry), which a rerun sends again."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson

from app.checkpoints.output import OutputError, is_remote
from app.store.batches import BatchDir
from app.store.durable import fsync_dir, make_dirs_durable


@dataclass
class Written:
    lines: int = 0
    errors: int = 0  # answered with a 4xx (or a 2xx body that is an error)
    upstream_errors: int = 0  # no answer after every retry
    last_error: str = ""  # the message of the last of those, in input order


def _write_lines(folder: BatchDir, out: IO[bytes]) -> Written:
    written = Written()
    for result in folder.results_in_order():
        written.lines += 1
        if not result.ok:
            why = _unanswered(result.out)
            if why is not None:
                written.upstream_errors += 1
                written.last_error = why
            else:
                written.errors += 1
        out.write(result.out + b"\n")
    return written


def _unanswered(out: bytes) -> str | None:
    """Why the upstream never answered the line (every retry failed), if that is what its error says."""
    if b'"upstream_error"' not in out:
        return None
    error = orjson.loads(out).get("error")
    if not isinstance(error, dict) or error.get("code") != "upstream_error":
        return None
    return str(error.get("message") or "no reason given")


def upstream_errors(folder: BatchDir) -> int:
    return sum(1 for r in folder.results_in_order() if not r.ok and _unanswered(r.out) is not None)


def write_output(folder: BatchDir, output: str, state: Path, fsync: bool) -> Written:
    """Every line's result, in input order, to OUTPUT whole: a temporary file fsynced and renamed over it
    (local), or uploaded once complete (an object store: never a partial object)."""
    if is_remote(output):
        part = state / f".output.{secrets.token_hex(6)}.tmp"
        try:
            with part.open("wb") as out:
                written = _write_lines(folder, out)
            import fsspec

            fs, path = fsspec.core.url_to_fs(output)
            fs.put_file(str(part), path)
        finally:
            with contextlib.suppress(OSError):
                part.unlink()
        return written
    target = Path(output.removeprefix("file://")).absolute()
    with contextlib.suppress(FileNotFoundError):  # checked at the start; made since: never renamed over
        if not stat.S_ISREG(target.lstat().st_mode):
            raise OutputError(f"-o {output} is no longer a regular file: give a file's path")
    make_dirs_durable(str(target.parent))
    part = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
    try:
        with part.open("wb") as out:
            written = _write_lines(folder, out)
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise
    if fsync:
        fsync_dir(str(target.parent))
    return written

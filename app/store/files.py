"""Files kept for the Batch API (`/v1/files`): uploads, and the output and error files batches write.

    <root>/<file_id>            the bytes, as uploaded or written
    <root>/<file_id>.json       what OpenAI's `FileObject` says of it (filename, purpose, bytes, created_at,
                                expires_at)

A file exists once its `.json` does: the bytes are written under a temporary name, fsynced and renamed
first, then the metadata is written atomically, so that a crash at any point leaves the file whole or
absent (a temporary file or bytes without metadata are swept at the next start). Deleting removes the
metadata first, so a file is never listed without its bytes.

A file id holds when its file was begun: the second (`created_at`) in its first 8 hex digits, the
fraction of it in the next 4, then 12 random ones. Ids sort as `(created_at, id)` does, in the order the
files were begun, so that a listing resumes after an id (`list(after=...)`) even once that file is
deleted, and reads the metadata of the page it returns only.

A file uploaded with an expiry (`expires_at`) is gone from then on: `get` and `list` see it no more, at
once, and `remove_expired` removes its bytes, but those of the files it is told to keep (a running
batch's input, which the batch goes on reading). The time is the store's `clock` (tests move it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import orjson

from app.store.durable import atomic_write_bytes, check_safe, fsync_dir, make_dirs_durable, read_regular

logger = logging.getLogger(__name__)

#: What a file id looks like: OpenAI's prefix, then 24 hex digits. Anything else is no file of ours.
FILE_ID_PREFIX = "file-"
_ID_HEX = 24
_META = ".json"
#: How long what a crash left half-written must have gone unwritten to be removed (younger, it may be another
#: proxy's upload under way on a shared checkpoints dir): an upload writes as its body comes, which must all
#: come within `body_timeout_s` (300 s by default).
STALE_AFTER_S = 600.0
_PART = ".part"


def new_file_id(now: float) -> str:
    """A new id, begun at `now` (seconds since the epoch, up to 2106): it sorts after those begun before."""
    fraction = int((now % 1) * 0x10000)
    return f"{FILE_ID_PREFIX}{int(now):08x}{fraction:04x}{secrets.token_hex((_ID_HEX - 12) // 2)}"


def is_file_id(value: str) -> bool:
    hexes = value[len(FILE_ID_PREFIX) :]
    return value.startswith(FILE_ID_PREFIX) and len(hexes) == _ID_HEX and all(c in "0123456789abcdef" for c in hexes)


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A file's metadata: the fields of OpenAI's `FileObject` it has."""

    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None  # none: kept until deleted

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


def _half_written(root: Path, name: str) -> bool:
    """An upload or output cut short, bytes whose metadata was never written, or an atomic write's
    temporary file."""
    if name.endswith(_PART) or (name.startswith(".") and name.endswith(".tmp")):
        return True
    return is_file_id(name) and not (root / (name + _META)).exists()


class FileTooLarge(ValueError):
    """An upload past the store's limit: nothing of it is kept."""


class FileWriter:
    """A file being written (an upload as it arrives, a batch's output): `write`, then the store's `commit`
    (or `abandon`)."""

    def __init__(
        self, store: FileStore, filename: str, purpose: str, limit: int | None, file_id: str | None = None
    ) -> None:
        now = store.clock()
        self.created_at = int(now)
        self.id = file_id or new_file_id(now)
        self.filename = filename
        self.purpose = purpose
        #: seconds after `created_at` at which the file expires (OpenAI's `expires_after`); None: never
        self.expires_after: int | None = None
        self.limit = limit
        self.size = 0
        self.part = store.root / (self.id + _PART)
        self.final = store.root / self.id
        if file_id is not None:
            # A reserved id is its caller's alone (a batch's output, under the batch's lock): what a crash left
            # of an earlier attempt at it is that caller's too, and is written over.
            with contextlib.suppress(FileNotFoundError):
                self.part.unlink()
        self._file: BinaryIO = self.part.open("xb")
        self._renamed = False  # whether `final` is this writer's (its part renamed there)
        self._store = store
        store.writing_ids.add(self.id)

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.limit is not None and self.size > self.limit:
            raise FileTooLarge(f"the file exceeds {self.limit} bytes (max_file_bytes)")
        self._file.write(data)

    def finish(self, fsync: bool) -> None:
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._file.close()

    def abandon(self) -> None:
        """Remove whatever of the file this writer wrote (before its metadata: a committed file stays). A
        `final` it did not rename there is not its own: another process's, under a reserved id it took over."""
        with contextlib.suppress(OSError):
            self._file.close()
        for path in (self.part, self.final) if self._renamed else (self.part,):
            with contextlib.suppress(OSError):
                path.unlink()
        self.done()

    def done(self) -> None:
        """No longer written by this process: a sweep may look at what is left of it."""
        self._store.writing_ids.discard(self.id)


class FileStore:
    """The files under one folder (`<checkpoints_dir>/files`). Synchronous: callers run it in a thread
    where a write may be long (an upload's pieces are small and written as they come)."""

    def __init__(self, root: str | Path, *, fsync: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.clock = clock
        self._damaged: set[str] = set()  # the ids whose metadata could not be read, warned of once
        #: the ids this process is writing now: never swept, however long an upload waits for its next piece
        self.writing_ids: set[str] = set()

    def open(self, *, stale_after_s: float = STALE_AFTER_S) -> None:
        """Create the folder; sweep what a crash left half-written (`sweep_half_written`)."""
        make_dirs_durable(str(self.root))
        self.sweep_half_written(stale_after_s)

    def sweep_half_written(self, stale_after_s: float = STALE_AFTER_S) -> list[str]:
        """Remove what a crash left half-written (an upload's `.part`, bytes without metadata) and unwritten for
        `stale_after_s` or more: younger, it may be another proxy's upload under way on a checkpoints dir they
        share. 0: all of it, whatever its age, for a store no other process writes to (run-batch's, under its
        lock). The names removed."""
        stale = time.time() - stale_after_s  # against the files' mtimes: the wall clock, whatever `clock` is
        removed = []
        for path in self.root.iterdir():
            if path.name.removesuffix(_PART) in self.writing_ids:
                continue
            if _half_written(self.root, path.name):
                with contextlib.suppress(OSError):
                    if stale_after_s <= 0 or path.stat().st_mtime < stale:
                        path.unlink()
                        removed.append(path.name)
        return removed

    @contextlib.contextmanager
    def writing(
        self, filename: str, purpose: str, *, limit: int | None = None, file_id: str | None = None
    ) -> Iterator[FileWriter]:
        """A new file: written inside the block, kept (durably, with its metadata) when it ends, removed if
        it raises. Its `StoredFile` is then `store.get(writer.id)`. `file_id`: the id to write it under (one
        reserved beforehand, so that a write cut short by a crash is done again under the same id)."""
        writer = self.start(filename, purpose, limit=limit, file_id=file_id)
        try:
            yield writer
        except BaseException:
            writer.abandon()
            raise
        self.commit(writer)

    def start(self, filename: str, purpose: str, *, limit: int | None = None, file_id: str | None = None) -> FileWriter:
        """A new file, for a writer whose writes and commit are not in one block (an upload awaiting its
        pieces): `commit` it, or `abandon` it."""
        return FileWriter(self, filename, purpose, limit, file_id)

    def commit(self, writer: FileWriter) -> StoredFile:
        """Keep the file `writer` wrote, durably, with its metadata; if that fails, nothing of it is kept."""
        try:
            writer.finish(self.fsync)
            os.replace(writer.part, writer.final)
            writer._renamed = True
            if self.fsync:
                fsync_dir(str(self.root))
            expires_at = None if writer.expires_after is None else writer.created_at + writer.expires_after
            meta = StoredFile(writer.id, writer.filename, writer.purpose, writer.size, writer.created_at, expires_at)
            atomic_write_bytes(str(self.root / (writer.id + _META)), orjson.dumps(asdict(meta)))
        except BaseException:
            writer.abandon()
            raise
        writer.done()
        return meta

    def read(self, file_id: str) -> StoredFile:
        """The file's metadata as on disk, expired or not: `FileNotFoundError` if there is none; `OSError`,
        `ValueError` or `TypeError` if it is damaged (a `.json` that is no file's metadata, or a link or
        a special file for it or its bytes, `UnsafeFileError`)."""
        found = StoredFile(**orjson.loads(read_regular(str(self.root / (file_id + _META)))))
        check_safe(str(self.root / file_id))  # its bytes too: a link there is no file either
        return found

    def get(self, file_id: str, *, expired_too: bool = False) -> StoredFile | None:
        """The file, if there is one and it has not expired (`expired_too`: even if it has, for the batch
        that reads it as its input); a damaged one is none, said once."""
        if not is_file_id(file_id):
            return None
        try:
            found = self.read(file_id)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:
            if file_id not in self._damaged:
                self._damaged.add(file_id)
                logger.warning("files/%s is damaged, so no such file is served (%s)", file_id, exc)
            return None
        return found if expired_too or not found.expired(self.clock()) else None

    def path(self, file_id: str) -> Path:
        """Where the bytes of a file `get` found are."""
        return self.root / file_id

    def delete(self, file_id: str) -> StoredFile | None:
        """Remove a file; the one removed, or None if there was none (or it had expired)."""
        found = self.get(file_id)
        if found is None:
            return None
        self._remove(file_id)
        return found

    def remove_expired(self, *, keep: Collection[str] = (), file_ids: Collection[str] | None = None) -> list[str]:
        """Remove the files that have expired (of `file_ids`, or all), but those in `keep`; the ids removed."""
        now = self.clock()
        if file_ids is None:
            file_ids = [name[: -len(_META)] for name in os.listdir(self.root) if name.endswith(_META)]
        removed = []
        for file_id in file_ids:
            found = self.get(file_id, expired_too=True)
            if found is not None and found.expired(now) and file_id not in keep:
                self._remove(file_id)
                removed.append(file_id)
        return removed

    def _remove(self, file_id: str) -> None:
        """The metadata first, so that a file is never listed without its bytes."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / (file_id + _META))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / file_id)
        if self.fsync:
            fsync_dir(str(self.root))

    def list(
        self,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[StoredFile]:
        """The files (of `purpose`, if given) in the order of `(created_at, id)`, newest first unless told
        otherwise: those that come after the id `after` in that order (whether or not it still exists),
        at most `limit` of them."""
        ids = sorted(
            (name[: -len(_META)] for name in os.listdir(self.root) if name.endswith(_META)), reverse=newest_first
        )
        ids = [file_id for file_id in ids if is_file_id(file_id)]
        if after is not None:
            ids = [file_id for file_id in ids if (file_id < after if newest_first else file_id > after)]
        found: list[StoredFile] = []
        for file_id in ids:
            if limit is not None and len(found) >= limit:
                break
            stored = self.get(file_id)  # None if deleted meanwhile, or expired
            if stored is not None and (purpose is None or stored.purpose == purpose):
                found.append(stored)
        return found

"""Files that survive a crash: appends that never leave a torn line behind,
atomic replacement, and one fsync shared by every concurrent writer.

Rules these helpers keep, so callers do not have to:

- an append either lands whole or the file is cut back to where it was;
- a replaced file is written under a temporary name, fsynced, renamed over
  the old one with `os.replace`, and the directory is fsynced;
- a writer waiting for durability waits for an fsync that started after its
  write, and concurrent writers share it (group commit);
- a checkpoint file is opened only if it is a regular file, never through a
  symbolic link (`open_regular`): a shared checkpoints dir is writable by
  others, and a link planted there must not make a proxy cut another file.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import secrets
import sqlite3
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeGuard

import orjson

logger = logging.getLogger(__name__)


#: How the system refuses a write for want of space: none left on the disk, or the user's quota there used up.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: How SQLite does: SQLITE_FULL ("database or disk is full") for a write, SQLITE_IOERR_SHMSIZE ("disk I/O
#: error") for the WAL index (`-shm`) it creates when it opens a file, which SQLite's documentation says
#: "may indicate that the underlying filesystem volume is out of space" (a released rank reopened so).
_SQLITE_DISK_FULL = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR_SHMSIZE})


def is_disk_full(exc: BaseException | None) -> TypeGuard[OSError | sqlite3.Error]:
    """Whether `exc` is a write refused because its disk is full: ENOSPC or EDQUOT, or SQLite's words for
    it (`_SQLITE_DISK_FULL`). Storage errors that wrap one (`CacheWriteError`, `PublishError`) hold it as
    their `__cause__`: the caller, which knows what failed, asks about that.
    """
    if isinstance(exc, OSError):
        return exc.errno in DISK_FULL_ERRNOS
    return isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) in _SQLITE_DISK_FULL


def refusal_reason(exc: OSError | sqlite3.Error) -> str:
    """Why a write was refused, in the system's words ("No space left on device", "Disk quota exceeded") or
    SQLite's, without the file: for a message that names the folder to act on itself."""
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def fsync_dir(path: str) -> None:
    """fsync a directory, so that names created, renamed or removed in it persist."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """fsync a regular file by its name (never through a link), so that what is in it persists."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(path: str, *, under: str | None = None) -> None:
    """Create `path` and any missing parents, fsyncing each parent that gained an entry.

    A folder whose parent's fsync fails is removed again (it is empty: just made), so that a retry makes
    it, and fsyncs its parent, anew: one left in place would be found there and its name never made
    durable. `under`, if given, must exist already: only folders below it are created (a local output
    folder gone under a running proxy, its file system unmounted, is not made again on the mount point).
    """
    missing: list[str] = []
    current = os.path.abspath(path)
    top = os.path.abspath(under) if under is not None else None
    while not os.path.isdir(current):
        if current == top:
            if os.path.lexists(top):
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", top)
            raise FileNotFoundError(errno.ENOENT, "the folder is gone (removed, or its file system unmounted)", top)
        missing.append(current)
        current = os.path.dirname(current)
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):  # a file where the folder should be
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", directory) from None
            made = False  # made by another meanwhile
        else:
            made = True
        try:
            fsync_dir(os.path.dirname(directory))
        except OSError:
            if made:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
            raise


def atomic_write_bytes(
    path: str, data: bytes, *, check: Callable[[], None] | None = None, under: str | None = None
) -> None:
    """Replace `path` with `data`: readers see the old content or the new, never a mix.

    The temporary name is unique to this write (`.<name>.<random>.tmp`), so two writers of one
    path never meet in one file: a writer that lost the right to write (a rank taken over by another
    proxy) cannot truncate or cut the other's. `check`, if given, is called before each piece of
    `data` is written and once more just before the rename: raising from it gives the write up,
    the temporary file removed and `path` untouched. `under`: the folder that must exist already, as
    `make_dirs_durable` takes it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    make_dirs_durable(directory, under=under)
    tmp_path = _durable_temp(path, data, check=check)
    try:
        if check is not None:
            check()
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)
        raise
    fsync_dir(directory)


def temporary_target(name: str) -> str | None:
    """The file a temporary file named `name` was written for by `atomic_write_bytes`
    (`.<target>.<random>.tmp`, or `.<target>.tmp` as earlier versions named it); None for other names."""
    if not (name.startswith(".") and name.endswith(".tmp")) or len(name) <= len("..tmp"):
        return None
    middle = name[1 : -len(".tmp")]
    target, _, token = middle.rpartition(".")
    if target and len(token) == 12 and all(c in "0123456789abcdef" for c in token):
        return target
    return middle


def create_exclusive_bytes(path: str, data: bytes) -> None:
    """Create `path` whole with `data`, or raise `FileExistsError` and change nothing.

    Written under a temporary name and fsynced, then hard-linked to its name
    (a link never replaces, unlike a rename), so a reader sees no file or
    the whole of it, and of two creators exactly one wins.
    """
    tmp_path = _durable_temp(path, data)
    try:
        os.link(tmp_path, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


#: Bytes written between two calls of a write's `check` (a publication can be given up within one piece).
WRITE_PIECE = 1 << 20


def _durable_temp(path: str, data: bytes, *, check: Callable[[], None] | None = None) -> str:
    """A new file `.<name>.<random>.tmp` beside `path` holding `data`, fsynced; its path.

    Created with mode 0666 less the umask, as `open()` would make it (the
    file is published for other users and jobs; `mkstemp` makes 0600, and
    reading the umask means setting it, which races with other threads).
    """
    directory, name = os.path.split(os.path.abspath(path))
    while True:
        tmp_path = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as tmp:
            view = memoryview(data)
            for start in range(0, len(data), WRITE_PIECE):
                if check is not None:
                    check()
                tmp.write(view[start : start + WRITE_PIECE])
            tmp.flush()
            os.fsync(tmp.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)
        raise
    return tmp_path


class AppendFile:
    """An append-only file whose every append is a whole line or nothing.

    The size is tracked so that a failed write (disk full mid-line) is undone
    with `ftruncate`: the next append can never glue onto half a line. While
    a `GroupSync` round is fsyncing the file, `close()` is deferred to the end
    of that round, so a descriptor is never closed (or reused) under an fsync.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.size = os.fstat(self.fd).st_size
        self._pins = 0
        self._close_requested = False

    @property
    def closed(self) -> bool:
        return self.fd < 0 or self._close_requested

    def append(self, data: bytes) -> int:
        """Append `data`; return the offset it starts at. On failure the file is as before."""
        start = self.size
        written = 0
        try:
            written = os.write(self.fd, data)  # almost always all of it at once
            while written < len(data):
                n = os.write(self.fd, memoryview(data)[written:])
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
                written += n
        except BaseException:
            # Cut back even when no byte was reported written: a failing
            # write may still have extended the file.
            self.truncate(start)
            raise
        self.size = start + written
        return start

    def truncate(self, size: int) -> None:
        """Cut the file back to `size` bytes (undo appends after that offset)."""
        try:
            os.ftruncate(self.fd, size)
        except OSError:
            logger.exception("could not cut %s back to %d bytes after a failed append", self.path, size)
            raise
        self.size = size

    def close(self) -> None:
        """Close now, or at the end of the fsync round using the descriptor; idempotent."""
        self._close_requested = True
        if self._pins == 0 and self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def _pin(self) -> int:
        self._pins += 1
        return self.fd

    def _unpin(self) -> None:
        self._pins -= 1
        if self._close_requested:
            self.close()


class GroupSync:
    """One fsync shared by every writer waiting at the same time (group commit).

    `await sync(file)` returns once an fsync of `file` that started after the
    call has finished. Writers arriving while an fsync runs are served
    together by the next one, so N concurrent writers cost about two fsyncs,
    not N. An fsync error reaches every writer of that round, and every later one (`failed`): Linux
    reports a writeback error once, so the next fsync's success would say nothing of the pages it lost.
    """

    def __init__(self) -> None:
        self._dirty: dict[int, AppendFile] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._runner: asyncio.Task[None] | None = None
        #: The error of the first fsync that failed, if one did.
        self.failed: OSError | None = None

    def _refusal(self) -> OSError:
        failed = self.failed
        assert failed is not None
        error = OSError(failed.errno, f"an earlier fsync of these files failed ({failed})")
        error.__cause__ = failed
        return error

    async def sync(self, *files: AppendFile) -> None:
        if self.failed is not None:
            raise self._refusal()
        for file in files:
            self._dirty[id(file)] = file
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        if self._runner is None:
            self._runner = asyncio.create_task(self._run())
        # A cancelled caller cancels only its own waiter: the fsync runs in
        # the runner task, which others share, and skips waiters already done.
        await waiter

    async def _run(self) -> None:
        try:
            while self._waiters:
                # One turn of the event loop first: writers already runnable append and join
                # this round instead of paying for the next one.
                await asyncio.sleep(0)
                waiters, self._waiters = self._waiters, []
                files = [f for f in self._dirty.values() if f.fd >= 0]
                self._dirty = {}
                fds = [f._pin() for f in files]
                try:
                    if self.failed is not None:  # joined while the round that failed ran
                        raise self._refusal()
                    await asyncio.to_thread(_fsync_all, fds)
                except BaseException as exc:  # every waiter learns of it; none hangs
                    if isinstance(exc, OSError) and self.failed is None:
                        self.failed = exc
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_exception(exc)
                else:
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_result(None)
                finally:
                    for file in files:
                        file._unpin()
        finally:
            self._runner = None


#: Called with the seconds of every fsync round (`app.ops.metrics` adds its histogram's `observe`).
FSYNC_OBSERVERS: list[Callable[[float], None]] = []


def _fsync_all(fds: Iterable[int]) -> None:
    started = time.monotonic()
    for fd in fds:
        os.fsync(fd)
    elapsed = time.monotonic() - started
    for observe in FSYNC_OBSERVERS:
        observe(elapsed)


#: The most read of a file that holds a few bytes (checkpoint_meta.json, a last_chunk file, an owner lock):
#: anything larger is not one of them.
SMALL_FILE_BYTES = 4096


class CorruptFileError(ValueError):
    """A JSONL file damaged before its last line: not a torn append, so not repaired silently."""


class UnsafeFileError(OSError):
    """A checkpoint path that is a symbolic link, or not a regular file (a FIFO, a device, a folder).

    Never opened: whoever can write in a shared checkpoints dir could otherwise make a proxy read,
    cut or overwrite the file a link points to (as root, any file), or hang on a FIFO.
    """


_KINDS = {
    stat.S_IFREG: "a file",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
}


def _check_mode(path: str, mode: int, *, folder: bool = False) -> None:
    if stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode):
        return
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    expected = "a folder" if folder else "a regular file"
    raise UnsafeFileError(
        f"{path} is {kind}, not {expected}: inferproxy opens nothing in a checkpoints dir through a link or of "
        f"another kind (it could be made to read, cut or overwrite another file). Remove it, or put the "
        f"{'folder' if folder else 'file'} itself there, then retry"
    )


def check_safe(path: str, *, folder: bool = False) -> None:
    """Raise `UnsafeFileError` if `path` is a symbolic link or anything but a regular file (a real folder,
    with `folder`); nothing there is fine. For what others open (SQLite) and what is created later."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    _check_mode(path, mode, folder=folder)


def open_regular(path: str, flags: int) -> int:
    """`os.open` of the regular file at `path` (created with mode 0644 if `flags` says so), never through a
    symbolic link and never of a FIFO or a device: `UnsafeFileError` for those, which are not opened.

    Checked before the open (opening a device can act on it), and on the open descriptor (a link put
    there in between is refused by `O_NOFOLLOW`; a FIFO, opened without blocking, by `fstat`).
    """
    check_safe(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # swapped in since the check
            check_safe(path)
        raise
    try:
        _check_mode(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_to_read(path: str | os.PathLike[str]) -> BinaryIO:
    """The regular file at `path`, open for reading (`open_regular`: never through a link, never a FIFO)."""
    return os.fdopen(open_regular(os.fspath(path), os.O_RDONLY), "rb")


def read_regular(path: str, *, limit: int | None = None) -> bytes:
    """The content of the regular file at `path` (`open_regular`); with `limit`, `ValueError` for a file
    larger than `limit` bytes, of which no more than that is read."""
    with open_to_read(path) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"more than {limit} bytes")
    return data


def read_jsonl_whole_lines(path: str) -> list[Any]:
    """Decode the whole lines of a JSONL file, leaving a torn tail (and the file) alone: for readers
    that must not cut what a concurrent writer may be appending."""
    data = read_regular(path)
    end = data.rfind(b"\n") + 1
    return [orjson.loads(line) for line in data[:end].split(b"\n") if line.strip(b" \t\r\0")]


@dataclass(frozen=True, slots=True)
class JsonlScan:
    """An append-only JSONL file as read: its whole lines decoded, and where a torn tail starts."""

    records: list[Any]
    size: int
    torn_at: int | None  # the offset of a torn last line, which a repair cuts the file back to
    torn_line: int = 0


class JsonlLines:
    """An append-only JSONL file read line by line: iterating yields the records of its whole lines,
    so a reader holds one line at a time, never the file.

    A crash mid-append leaves a last line without its newline, or garbage (a
    power cut can leave NUL bytes): that tail is not yielded, and once the
    iteration ends `torn_at` is its offset (None if there is none) and
    `size` the file's. A bad line followed by good ones is not a torn
    append: the iteration raises `CorruptFileError` naming the file and line.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = 0
        self.torn_at: int | None = None
        self.torn_line = 0

    def __iter__(self) -> Iterator[Any]:
        # The common line costs one parse and one test: offsets and line numbers are worked out
        # only for a bad line (a million lines a second matter on resume, bench/README.md).
        loads, decode_error = orjson.loads, orjson.JSONDecodeError
        torn_at: int | None = None
        with open_to_read(self.path) as f:
            # A torn last line may be as large as the file (a crash mid-append of a huge document, a disk's
            # garbage): read whole, it would be held twice over. Where the end holds no newline, it is not.
            size = os.fstat(f.fileno()).st_size
            tail = os.pread(f.fileno(), _LONG_LINE, max(0, size - _LONG_LINE))
            long_tail: list[int] = []
            lines = f if size <= _LONG_LINE or b"\n" in tail else _lines_but_a_long_tail(f, long_tail)
            for line in lines:
                try:
                    record = loads(line)  # the newline and the blanks around a record are JSON whitespace
                except decode_error:
                    if torn_at is None and (line[-1:] != b"\n" or line.strip(b" \t\r\n\0")):
                        torn_at = f.tell() - len(line)
                    continue
                if line[-1] != 0x0A:  # a last line without its newline is torn, even where it parses
                    torn_at = f.tell() - len(line) if torn_at is None else torn_at
                elif torn_at is not None:
                    raise CorruptFileError(
                        f"{self.path}: line {self._line_at(torn_at)} is not valid JSON but whole lines follow it; this "
                        f"is not a torn append from a crash. Move the file aside or repair that line, then restart."
                    )
                else:
                    yield record
            self.size = f.tell()
        if long_tail and torn_at is None:
            torn_at = long_tail[0]
        self.torn_at = torn_at
        self.torn_line = 0 if torn_at is None else self._line_at(torn_at)

    def _line_at(self, offset: int) -> int:
        """The number of the line that starts at `offset`."""
        with open_to_read(self.path) as f:
            return f.read(offset).count(b"\n") + 1

    def repair(self) -> None:
        """Cut the torn tail found by the iteration off the file, so that later appends never glue onto it."""
        if self.torn_at is None:
            return
        logger.warning(
            "%s: dropping a torn last line (%d bytes from line %d), left by a crash mid-append",
            self.path,
            self.size - self.torn_at,
            self.torn_line,
        )
        with os.fdopen(open_regular(self.path, os.O_RDWR), "r+b") as f:  # never through a link
            f.truncate(self.torn_at)
            f.flush()
            os.fsync(f.fileno())


#: A last line longer than this without a newline is not read whole (`JsonlLines`).
_LONG_LINE = 1 << 20


def _lines_but_a_long_tail(f: BinaryIO, long_tail: list[int]) -> Iterator[bytes]:
    """The lines of `f` as iterating it gives them, but for a last one over `_LONG_LINE` bytes without a
    newline, read a piece at a time and not given: its offset goes to `long_tail`."""
    for line in iter(functools.partial(f.readline, _LONG_LINE), b""):
        if len(line) == _LONG_LINE and line[-1] != 0x0A:
            start = f.tell() - len(line)
            while piece := f.readline(_LONG_LINE):
                if piece[-1] == 0x0A:
                    break
            else:
                long_tail.append(start)
                return
            f.seek(start)
            line = f.readline()  # a long line that ends: read whole, as any other
        yield line


def scan_jsonl(path: str) -> JsonlScan:
    """Decode every line of an append-only JSONL file (`JsonlLines`) and find a torn tail, changing nothing."""
    lines = JsonlLines(path)
    records = list(lines)
    return JsonlScan(records, lines.size, lines.torn_at, lines.torn_line)


def read_jsonl_repairing_tail(path: str) -> list[Any]:
    """Decode every line of an append-only JSONL file (`JsonlLines`), cutting a torn tail off the file."""
    lines = JsonlLines(path)
    records = list(lines)
    lines.repair()
    return records

"""A batch on disk (the Batch API's, `/v1/batches`): its record and the results of its lines.

    <batches_dir>/<batch_id>/batch.json      the batch as `GET /v1/batches/{id}` shows it (replaced atomically)
    <batches_dir>/<batch_id>/results.jsonl   one line per input line answered: {"line", "ok", "out"}
    <batches_dir>/<batch_id>/owner.lock      flock'ed by the proxy running the batch
    <batches_dir>/answers/<host>/00000/replay.sqlite3  the answers of the batches run on one host, found
                                                across them (`host_answers`)
    <batches_dir>/answers/forgotten/<serial>    a batch whose output file was deleted: every host's
                                                cache drops its answers

A line is done once its result is in `results.jsonl` and fsynced: the counts a batch shows are those of
that file, so they never go back after a crash. `out` is the line of the output file (`ok`) or of the
error file as OpenAI writes them; the files are written from `results.jsonl` when the batch finalizes.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import re
import secrets
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from app.store.durable import (
    AppendFile,
    CorruptFileError,
    JsonlLines,
    atomic_write_bytes,
    check_safe,
    fsync_dir,
    make_dirs_durable,
    open_regular,
    open_to_read,
    read_regular,
)

BATCH_ID_PREFIX = "batch_"
_ID_HEX = 24
RECORD = "batch.json"
RESULTS = "results.jsonl"
OWNER = "owner.lock"
#: A cancel asked through a proxy that does not run the batch: its time, for the owner to carry out. Never
#: `batch.json`, which only the owner writes (a save of its counts could land over the cancel and lose it).
CANCEL = "cancel"
#: The folder of the answers' caches (each a `RequestCache` base dir whose rank 0 holds the answers).
ANSWERS = "answers"
#: Under ANSWERS: the serials of the batches whose answers are forgotten (their output file deleted).
FORGOTTEN = "forgotten"
#: Under ANSWERS: the rank folder of a cache of all the batches in one file, as proxies kept it before
#: `host_answers` (and as `inferproxy run-batch` keeps it: one process).
SHARED_RANK = "00000"
#: Serials are below this (62 random bits): under SQLite's 64-bit integers.
SERIALS = 2**62
#: The start of a host's folder under ANSWERS (`host_answers`).
HOST_PREFIX = "host-"


def host_answers(answers_dir: str) -> str:
    """This host's answers' cache folder under `answers_dir`: `host-<hostname>`.

    Proxies on many hosts may share a checkpoints dir, and SQLite's WAL keeps a file's index in memory
    shared by its processes, which only processes on one kernel can share: one file written from two hosts
    is corrupted. So each host has its own, named by its hostname (distinct on a cluster: Slurm's node
    names, Kubernetes' pod names), which the proxies of one host share, and which a host finds again
    after a reboot (a name with the boot's id in it would leave a folder behind at each)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "unnamed"
    return os.path.join(answers_dir, HOST_PREFIX + host)


def take_shared_answers(answers_dir: str, folder: str) -> None:
    """Move the one answers' file of before (`SHARED_RANK`, every host's), if any, into this host's new
    `folder`: a rename, so that on a shared dir one host gets it and the others start their own."""
    legacy = os.path.join(answers_dir, SHARED_RANK)
    if os.path.isdir(legacy) and not os.path.islink(legacy) and not os.path.lexists(folder):
        make_dirs_durable(folder)
        with contextlib.suppress(OSError):  # gone meanwhile: another proxy took it
            os.rename(legacy, os.path.join(folder, SHARED_RANK))
            fsync_dir(folder)
            fsync_dir(answers_dir)


#: A batch's statuses; those a proxy still has work for, and those that are final.
ACTIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
FINAL = frozenset({"completed", "failed", "expired", "cancelled"})


def new_batch_id(now: float) -> str:
    """A new id, made at `now` (seconds since the epoch, up to 2106): ids sort in the order batches were made
    (`GET /v1/batches` lists them so, and pages on from an `after` that is gone)."""
    fraction = int((now % 1) * 0x10000)
    return f"{BATCH_ID_PREFIX}{int(now):08x}{fraction:04x}{secrets.token_hex((_ID_HEX - 12) // 2)}"


def is_batch_id(value: str) -> bool:
    hexes = value[len(BATCH_ID_PREFIX) :]
    return value.startswith(BATCH_ID_PREFIX) and len(hexes) == _ID_HEX and all(c in "0123456789abcdef" for c in hexes)


def forget_answers(answers_dir: str, serial: int) -> None:
    """Record, durably, that the answers of batch `serial` are forgotten: every host's cache drops them.
    `UnsafeFileError` (an `OSError`) for a link or a file planted as the folder: never written through."""
    folder = os.path.join(answers_dir, FORGOTTEN)
    check_safe(folder, folder=True)
    make_dirs_durable(folder)
    check_safe(folder, folder=True)  # made, or found, a folder, not a link put there meanwhile
    atomic_write_bytes(os.path.join(folder, str(serial)), b"")


def forgotten_answers(answers_dir: str) -> list[int]:
    """The serials `forget_answers` recorded; names that are no serial (anything planted, a number past 62
    bits, which SQLite could not even compare) are not. `OSError` if the folder cannot be read (a link or a
    file planted there is `UnsafeFileError`)."""
    folder = os.path.join(answers_dir, FORGOTTEN)
    try:
        check_safe(folder, folder=True)
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return [
        int(name) for name in names if name.isascii() and name.isdigit() and len(name) <= 19 and int(name) < SERIALS
    ]


@dataclass(slots=True)
class BatchRecord:
    """What is kept of a batch: the fields of OpenAI's `Batch`, and `serial` (the batch's number, under which
    its answers are kept in the answers' cache: deleting its output file drops them)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    serial: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    #: what the batch is finalizing into: completed, expired or cancelled
    ending: str | None = None
    usage: dict[str, int] = field(default_factory=lambda: {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0})

    @classmethod
    def from_json(cls, data: Any) -> BatchRecord:
        """The record a batch.json holds; `ValueError`, as for JSON that does not parse, for JSON that is no
        record (readers skip a batch.json being written or damaged alike)."""
        if not isinstance(data, dict):
            raise ValueError(f"a batch record is a JSON object, not a {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:  # a field missing
            raise ValueError(f"not a batch record: {exc}") from None

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))


@dataclass(frozen=True, slots=True)
class Result:
    """One line answered: its line number (1-based), whether it goes to the output file, the tokens its
    answer used (prompt, completion), and its line of the output or error file, as JSON."""

    line: int
    ok: bool
    tokens: tuple[int, int]
    out: bytes

    def to_line(self) -> bytes:
        """Its line of results.jsonl: `out` last and as it is (never parsed and written again)."""
        ok = b"true" if self.ok else b"false"
        return b'{"line":%d,"ok":%s,"tokens":[%d,%d],"out":%s}\n' % (self.line, ok, *self.tokens, self.out)


@dataclass(frozen=True, slots=True)
class Done:
    """A line of results.jsonl as a restart reads it back: which line, where it went, its tokens."""

    line: int
    ok: bool
    tokens: tuple[int, int]


@dataclass(frozen=True, slots=True)
class ResultsScan:
    """results.jsonl as read by `BatchDir.scan_results`: the input lines done, and a torn last line."""

    completed: int  # input lines whose first result goes to the output file
    failed: int  # to the error file
    size: int
    torn_at: int | None  # where a torn last line starts: a restart cuts the file back to it
    torn_result: int | None  # the input line the torn result was for, where what is left of it says


def _done(lines: JsonlLines) -> Iterator[Done]:
    """The results of `lines`' whole lines; `CorruptFileError` for one that is none."""
    for item in lines:
        line, ok = (item.get("line"), item.get("ok")) if isinstance(item, dict) else (None, None)
        if type(line) is not int or type(ok) is not bool:
            raise CorruptFileError(
                f'{lines.path}: a line is no result (an object with an integer "line" and a boolean "ok"): '
                f"{orjson.dumps(item)[:80].decode(errors='replace')}; move the file aside or repair that line"
            )
        prompt, completion = item.get("tokens") or (0, 0)
        yield Done(line, ok, (prompt, completion))


#: What starts every line of results.jsonl (`Result.to_line`): a torn one's input line, if it got that far.
_TORN_HEAD = re.compile(rb'\{"line":(\d+)[,}]')
_RESULT_HEAD = re.compile(rb'^\{"line":(\d+),"ok":(true|false),"tokens":\[(\d+,\d+)\],"out":')


def _parse_result(raw: bytes) -> Result:
    """A whole line of results.jsonl, `out` sliced as written (parsed only if it is not as written here)."""
    head = _RESULT_HEAD.match(raw)
    if head is not None and raw.endswith(b"}\n"):
        tokens = tuple(int(n) for n in raw[head.start(3) : head.end(3)].split(b","))
        return Result(int(head.group(1)), head.group(2) == b"true", (tokens[0], tokens[1]), raw[head.end() : -2])
    item = orjson.loads(raw)
    prompt, completion = item.get("tokens") or (0, 0)
    return Result(item["line"], item["ok"], (prompt, completion), orjson.dumps(item["out"]))


class BatchDir:
    """One batch's folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._results: AppendFile | None = None
        self._lock_fd = -1

    @property
    def id(self) -> str:
        return self.root.name

    def create(self, record: BatchRecord) -> bool:
        """The batch's folder made and taken by this process (`claim`) before its record is written: another
        proxy sharing the folder, looking for batches to carry on, never takes one being created. False,
        with nothing written, if another process holds it."""
        make_dirs_durable(str(self.root))
        if not self.claim():
            return False
        self.save(record)
        return True

    def load(self) -> BatchRecord:
        """The record, `cancelling` if a cancel was asked (`ask_cancel`) of a batch not yet ending; `UnsafeFileError`
        for a folder that is a link (never run nor read through)."""
        check_safe(str(self.root), folder=True)
        record = BatchRecord.from_json(orjson.loads(read_regular(str(self.root / RECORD))))
        if record.status in ("validating", "in_progress"):
            asked = self.cancel_asked()
            if asked is not None:
                record.status, record.cancelling_at, record.ending = "cancelling", asked, "cancelled"
        return record

    def cancel_asked(self) -> int | None:
        """When a cancel was asked of the batch through any proxy (`ask_cancel`), if one was."""
        try:
            return int(read_regular(str(self.root / CANCEL)))
        except FileNotFoundError:
            return None
        except ValueError:  # not as inferproxy writes it (whole, by a rename): asked all the same
            return int(os.stat(self.root / CANCEL).st_mtime)

    def save(self, record: BatchRecord) -> None:
        atomic_write_bytes(str(self.root / RECORD), record.to_json())

    def ask_cancel(self, at: int) -> None:
        """Ask the batch's owner, whichever proxy it is, to cancel it (`load` shows it `cancelling` from now)."""
        atomic_write_bytes(str(self.root / CANCEL), str(at).encode())

    # -- the owner's lock -------------------------------------------------------------------

    def claim(self) -> bool:
        """Take the batch for this process (flock, released when it dies); False if another holds it."""
        if self._lock_fd >= 0:
            return True
        fd = open_regular(str(self.root / OWNER), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def release(self) -> None:
        self.close_results()
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            os.close(fd)  # the flock goes with it

    # -- results ----------------------------------------------------------------------------

    def results(self) -> Iterator[Done]:
        """The lines answered so far, in the order they were; a torn last line (a crash mid-append) is cut
        off the file once read, so that the next append never glues onto it."""
        path = self.root / RESULTS
        if not path.exists():
            return
        lines = JsonlLines(str(path))
        yield from _done(lines)
        lines.repair()

    def scan_results(self) -> ResultsScan | None:
        """results.jsonl as `results` reads it back, counted as a restart counts it (each input line's first
        result), changing nothing: for a reader beside a proxy that may be appending to it (`inferproxy
        inspect`). None without the file; `CorruptFileError` for a line that is no result before the last."""
        path = self.root / RESULTS
        if not path.exists():
            return None
        lines = JsonlLines(str(path))
        seen: set[int] = set()
        completed = failed = 0
        for done in _done(lines):
            if done.line not in seen:
                seen.add(done.line)
                completed, failed = (completed + 1, failed) if done.ok else (completed, failed + 1)
        torn_result = None
        if lines.torn_at is not None:
            with open_to_read(path) as f:
                f.seek(lines.torn_at)
                head = _TORN_HEAD.match(f.read(64))
            torn_result = int(head.group(1)) if head else None
        return ResultsScan(completed, failed, lines.size, lines.torn_at, torn_result)

    def outputs(self) -> Iterator[tuple[int, bool, bytes]]:
        """(line, ok, out) of every whole line of results.jsonl, `out` as written: what the output and error
        files are made of. Read after `results` (which cuts a torn tail off)."""
        path = self.root / RESULTS
        if not path.exists():
            return
        with open_to_read(path) as f:
            for raw in f:
                if raw.strip(b" \t\r\n\0"):  # blank, or the NUL bytes a power cut leaves (`results` skips them too)
                    result = _parse_result(raw)
                    yield result.line, result.ok, result.out

    def results_in_order(self) -> Iterator[Result]:
        """Each input line's first result, in line order (as vLLM's run-batch writes its output): an index of
        where each result starts, 8 bytes a line, then one read per line. Whole lines only (a torn tail is
        not a result)."""
        path = self.root / RESULTS
        if not path.exists():
            return
        starts = array.array("q")  # by line number: the offset of its first result, plus one (0: none yet)
        with open_to_read(path) as f:
            offset = 0
            for raw in f:
                if raw.endswith(b"\n"):
                    with contextlib.suppress(orjson.JSONDecodeError):
                        line = orjson.loads(raw)["line"]
                        if line >= len(starts):
                            starts.frombytes(bytes(8 * max(line + 1 - len(starts), len(starts) // 2)))
                        if not starts[line]:
                            starts[line] = offset + 1
                offset += len(raw)
            for start in starts:
                if start:
                    f.seek(start - 1)
                    yield _parse_result(f.readline())

    def results_file(self) -> AppendFile:
        if self._results is None or self._results.closed:
            self._results = AppendFile(str(self.root / RESULTS))
        return self._results

    def append(self, results: list[Result], *, fsync: bool) -> None:
        """Append results (whole lines or nothing) and fsync them: they count as done once this returns."""
        file = self.results_file()
        file.append(b"".join(r.to_line() for r in results))
        if fsync:
            os.fsync(file.fd)

    def close_results(self) -> None:
        if self._results is not None:
            with contextlib.suppress(OSError):
                self._results.close()
            self._results = None

    def remove(self) -> None:
        """Delete the folder (a batch whose files are all gone)."""
        self.release()
        for path in self.root.iterdir():
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.root.rmdir()

"""A batch on disk (the Batch API's, `/v1/batches`): its record and the results of its lines.

    <batches_dir>/<batch_id>/batch.json      the batch as `GET /v1/batches/{id}` shows it (replaced atomically)
    <batches_dir>/<batch_id>/results.jsonl   one line per input line answered: {"line", "ok", "out"}
    <batches_dir>/<batch_id>/owner.lock      flock'ed by the proxy running the batch
    <batches_dir>/answers/00000/replay.sqlite3  the answers of every batch, found across batches

A line is done once its result is in `results.jsonl` and fsynced: the counts a batch shows are those of
that file, so they never go back after a crash. `out` is the line of the output file (`ok`) or of the
error file as OpenAI writes them; the files are written from `results.jsonl` when the batch finalizes.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from app.store.durable import AppendFile, JsonlLines, atomic_write_bytes, make_dirs_durable, read_regular

BATCH_ID_PREFIX = "batch_"
_ID_HEX = 24
RECORD = "batch.json"
RESULTS = "results.jsonl"
OWNER = "owner.lock"
#: The folder of the answers' cache (a `RequestCache` base dir; its rank 0 holds every batch's answers).
ANSWERS = "answers"

#: A batch's statuses; those a proxy still has work for, and those that are final.
ACTIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
FINAL = frozenset({"completed", "failed", "expired", "cancelled"})


def new_batch_id() -> str:
    return BATCH_ID_PREFIX + secrets.token_hex(_ID_HEX // 2)


def is_batch_id(value: str) -> bool:
    hexes = value[len(BATCH_ID_PREFIX) :]
    return value.startswith(BATCH_ID_PREFIX) and len(hexes) == _ID_HEX and all(c in "0123456789abcdef" for c in hexes)


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
    def from_json(cls, data: dict[str, Any]) -> BatchRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))


@dataclass(frozen=True, slots=True)
class Result:
    """One line answered: its line number (1-based), whether it goes to the output file, and the line."""

    line: int
    ok: bool
    out: dict[str, Any]


class BatchDir:
    """One batch's folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._results: AppendFile | None = None
        self._lock_fd = -1

    @property
    def id(self) -> str:
        return self.root.name

    def create(self, record: BatchRecord) -> None:
        make_dirs_durable(str(self.root))
        self.save(record)

    def load(self) -> BatchRecord:
        return BatchRecord.from_json(orjson.loads(read_regular(str(self.root / RECORD))))

    def save(self, record: BatchRecord) -> None:
        atomic_write_bytes(str(self.root / RECORD), record.to_json())

    # -- the owner's lock -------------------------------------------------------------------

    def claim(self) -> bool:
        """Take the batch for this process (flock, released when it dies); False if another holds it."""
        if self._lock_fd >= 0:
            return True
        fd = os.open(self.root / OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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

    def results(self) -> Iterator[Result]:
        """The lines answered so far, in the order they were; a torn last line (a crash mid-append) is cut
        off the file once read, so that the next append never glues onto it."""
        path = self.root / RESULTS
        if not path.exists():
            return
        lines = JsonlLines(str(path))
        for item in lines:
            yield Result(item["line"], item["ok"], item["out"])
        lines.repair()

    def results_in_order(self) -> Iterator[Result]:
        """Each input line's first result, in line order (as vLLM's run-batch writes its output): an index of
        where each result starts, 8 bytes a line, then one read per line. Whole lines only (a torn tail is
        not a result)."""
        path = self.root / RESULTS
        if not path.exists():
            return
        starts = array.array("q")  # by line number: the offset of its first result, plus one (0: none yet)
        with path.open("rb") as f:
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
                    item = orjson.loads(f.readline())
                    yield Result(item["line"], item["ok"], item["out"])

    def results_file(self) -> AppendFile:
        if self._results is None or self._results.closed:
            self._results = AppendFile(str(self.root / RESULTS))
        return self._results

    def append(self, results: list[Result]) -> AppendFile:
        """Append results (whole lines or nothing); the caller fsyncs the file before counting them done."""
        file = self.results_file()
        file.append(b"".join(orjson.dumps({"line": r.line, "ok": r.ok, "out": r.out}) + b"\n" for r in results))
        return file

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

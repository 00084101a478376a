"""The Batch API's part of `inferproxy inspect`: the batches and files of a checkpoints dir, read without writing.

Per batch (`<checkpoints>/batches/<id>/`): its record as `GET /v1/batches/{id}` shows it, the lines its
results.jsonl holds (what a restarted proxy carries the batch on from: batch.json's counts lag them), a torn
last line there, its input file and whether it is still there, and whether a live process runs it (its
`owner.lock`: a proxy, or `inferproxy run-batch`; the file names neither). Per file (`<checkpoints>/files/`):
what `GET /v1/files` lists. Then the answers' caches the batches share (one per host). Everything is read by the store's
own readers (`BatchDir`, `FileStore`, `count_entries`, `probe_owner`) in their read-only forms; links and
special files are problem lines, never opened.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.store.batches import (
    ACTIVE,
    ANSWERS,
    HOST_PREFIX,
    RECORD,
    RESULTS,
    BatchDir,
    BatchRecord,
    ResultsScan,
    is_batch_id,
)
from app.store.durable import CorruptFileError, UnsafeFileError, check_safe
from app.store.files import FileStore, StoredFile, is_file_id
from app.store.layout import CheckpointsLayout
from app.store.ownership import probe_owner
from app.tools.terminal import printable

#: The fields of a batch's record `inspect` shows, and the types inferproxy writes them with.
_RECORD_TYPES: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("status", (str,)),
    ("input_file_id", (str,)),
    ("total", (int,)),
    ("completed", (int,)),
    ("failed", (int,)),
    ("output_file_id", (str, type(None))),
    ("error_file_id", (str, type(None))),
)


@dataclass(slots=True)
class BatchReport:
    id: str  # its folder's name
    record: BatchRecord | None = None  # None: batch.json is missing or does not parse (see problems)
    results: ResultsScan | None = None  # None: no results.jsonl yet (or an unreadable one)
    input_exists: bool | None = None  # None: no record to name it
    held: bool | None = None  # whether a live process holds owner.lock; None: no owner.lock yet
    problems: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CacheNumbers:
    entries: int | None  # None: it cannot be read (see problems)
    bytes: int


@dataclass(slots=True)
class ApiReport:
    """The Batch API's files and batches in a checkpoints dir; `present`: whether it has any of their folders."""

    present: bool
    batches: list[BatchReport] = field(default_factory=list)
    files: list[StoredFile] = field(default_factory=list)
    answers: CacheNumbers | None = None  # None: no answers' cache
    problems: list[str] = field(default_factory=list)


def has_batch_api(layout: CheckpointsLayout) -> bool:
    """Whether `layout` holds the Batch API's folders (`files/`, `batches/`), links included."""
    return os.path.lexists(layout.files_dir) or os.path.lexists(layout.batches_dir)


#: How `inspect` reads a request cache: `(entries, bytes)` of the file (entries None if unreadable), None
#: without it; what is wrong goes to the list.
CacheReader = Callable[[str, list[str]], "tuple[int | None, int] | None"]


def inspect_api(layout: CheckpointsLayout, read_cache: CacheReader) -> ApiReport:
    """The Batch API's part of the dir; its `problems` are the dir's (a linked folder, one that cannot be listed)."""
    report = ApiReport(has_batch_api(layout))
    if not report.present:
        return report
    store = _file_store(layout, report)
    files = [] if store is None else _files(store, report)
    report.files = files or []
    if _safe_folder(layout.batches_dir, report.problems) and os.path.isdir(layout.batches_dir):
        try:
            names = sorted(os.listdir(layout.batches_dir))
        except OSError as exc:
            report.problems.append(f"cannot list {layout.batches_dir}: {exc.strerror}")
            return report
        for name in names:
            if is_batch_id(name):
                # files/ that cannot be listed: whether a batch's input is there is unknown, not missing
                report.batches.append(_batch(os.path.join(layout.batches_dir, name), store, files is not None))
        report.answers = _answers(os.path.join(layout.batches_dir, ANSWERS), read_cache, report.problems)
    return report


def _answers(answers_dir: str, read_cache: CacheReader, problems: list[str]) -> CacheNumbers | None:
    """The answers' caches summed: each host's (`host-*/`), and the one of every host a proxy kept before
    (or `inferproxy run-batch` keeps); None without any."""
    if not _safe_folder(answers_dir, problems) or not os.path.isdir(answers_dir):
        return None
    try:
        hosts = sorted(name for name in os.listdir(answers_dir) if name.startswith(HOST_PREFIX))
    except OSError as exc:
        problems.append(f"cannot list {answers_dir}: {exc.strerror}")
        return None
    total: CacheNumbers | None = None
    for base in [answers_dir, *(os.path.join(answers_dir, name) for name in hosts)]:
        rank = CheckpointsLayout(base).rank(0)
        if not _safe_folder(base, problems) or not _safe_folder(rank.rank_dir, problems):
            continue
        try:
            numbers = read_cache(rank.cache_file, problems)
        except UnsafeFileError as exc:
            problems.append(f"the batches' answers not read: {exc}")
            continue
        if numbers is not None:
            entries, size = numbers
            if total is not None:
                entries = None if total.entries is None or entries is None else total.entries + entries
                size += total.bytes
            total = CacheNumbers(entries, size)
    return total


def _safe_folder(path: str, problems: list[str]) -> bool:
    try:
        check_safe(path, folder=True)
    except UnsafeFileError as exc:
        problems.append(f"not read: {exc}")
        return False
    except OSError as exc:  # in a folder that cannot be searched
        problems.append(f"cannot read {path}: {exc.strerror}")
        return False
    return True


def _file_store(layout: CheckpointsLayout, report: ApiReport) -> FileStore | None:
    """The file store, read only (never `open`ed: that creates its folder and sweeps it)."""
    if not _safe_folder(layout.files_dir, report.problems) or not os.path.isdir(layout.files_dir):
        return None
    return FileStore(layout.files_dir, fsync=False)


def _files(store: FileStore, report: ApiReport) -> list[StoredFile] | None:
    """Every file the store lists, oldest first (None: its folder cannot be listed). Each is read alone
    (`FileStore.get`), so that one unreadable metadata file is a problem line, not a missing listing."""
    try:
        names = os.listdir(store.root)
    except OSError as exc:
        report.problems.append(f"cannot list {store.root}: {exc.strerror}")
        return None
    found = []
    for file_id in sorted(name.removesuffix(".json") for name in names if name.endswith(".json")):
        if not is_file_id(file_id):
            continue
        try:
            stored = store.read(file_id)  # expired ones too, and why a damaged one is no file
        except FileNotFoundError:
            continue  # deleted meanwhile
        except (OSError, TypeError, ValueError) as exc:
            why = printable(str(exc))[:300]
            report.problems.append(f"file {file_id} is damaged ({why}): a proxy neither lists nor serves it")
            continue
        if not os.path.lexists(store.path(file_id)):
            report.problems.append(f"file {file_id}: its bytes are missing: its content cannot be downloaded")
        found.append(stored)
    return found


def _batch(path: str, store: FileStore | None, inputs_known: bool) -> BatchReport:
    folder = BatchDir(path)
    report = BatchReport(folder.id)
    if not _safe_folder(path, report.problems):
        return report
    try:
        report.record = _checked(folder.load(), report)
    except FileNotFoundError:
        report.problems.append(f"{RECORD} is missing: being created, or no batch a proxy lists or runs")
    except (OSError, ValueError) as exc:
        report.problems.append(
            f"{RECORD} does not parse ({printable(str(exc))[:120]}): no proxy lists or runs this batch until it is "
            f"repaired or its folder removed"
        )
    try:
        report.results = folder.scan_results()
    except (OSError, CorruptFileError) as exc:
        report.problems.append(f"{RESULTS} cannot be read back, so no proxy can carry the batch on: {exc}")
    try:
        owner = probe_owner(os.path.join(path, "owner.lock"))
    except OSError as exc:
        report.problems.append(f"cannot test its owner.lock: {exc}")
    else:
        report.held = None if owner is None else owner.held
    record = report.record
    if record is not None and inputs_known:
        report.input_exists = store is not None and _exists(store, record.input_file_id)
        if not report.input_exists and record.status in ACTIVE:
            report.problems.append(_missing_input(record))
    return report


def _checked(record: BatchRecord, report: BatchReport) -> BatchRecord | None:
    """The record, or None (and a problem line) where a field shown is not of inferproxy's types."""
    for name, types in _RECORD_TYPES:
        value = getattr(record, name)
        if not isinstance(value, types) or isinstance(value, bool):
            report.problems.append(
                f"{RECORD} holds {printable(repr(value)[:80])} for {name}: not as inferproxy writes it, so the "
                f"batch is shown as unknown; repair it or remove the batch's folder"
            )
            return None
    return record


def _exists(store: FileStore, file_id: str) -> bool:
    try:
        return store.get(file_id) is not None
    except (OSError, TypeError, ValueError):
        return False


def _missing_input(record: BatchRecord) -> str:
    what = f"it is {record.status} but its input file {printable(record.input_file_id)} is missing"
    if record.status == "validating":
        return f"{what}: a proxy fails it (missing_input_file)"
    if record.status == "in_progress":
        return (
            f"{what}: the lines not done cannot be read, and a proxy running it tries again every 10 s; cancel it "
            f"(POST /v1/batches/{record.id}/cancel) to end it with the lines done"
        )
    if record.ending == "expired":
        return f"{what}: its error file lists the lines not run, read from it; a proxy finalizing it retries every 10 s"
    return f"{what}: a proxy still ends it, from results.jsonl alone"


# ----------------------------------------------------------------------- output


def to_json(report: ApiReport) -> dict[str, Any]:
    """The `--json` keys of the Batch API (docs/contract.md, "inferproxy inspect")."""
    return {
        "batches": [_batch_json(batch) for batch in report.batches],
        "files": [
            {
                "id": stored.id,
                "filename": stored.filename,
                "purpose": stored.purpose,
                "bytes": stored.bytes,
                "created_at": stored.created_at,
            }
            for stored in report.files
        ],
        "answers": None
        if report.answers is None
        else {"entries": report.answers.entries, "bytes": report.answers.bytes},
    }


def _batch_json(batch: BatchReport) -> dict[str, Any]:
    record, results = batch.record, batch.results
    return {
        "id": batch.id,
        "status": None if record is None else record.status,
        "request_counts": None
        if record is None
        else {"total": record.total, "completed": record.completed, "failed": record.failed},
        "results": None
        if results is None
        else {
            "completed": results.completed,
            "failed": results.failed,
            "bytes": results.size,
            "torn": None
            if results.torn_at is None
            else {"offset": results.torn_at, "bytes": results.size - results.torn_at, "line": results.torn_result},
        },
        "input_file_id": None if record is None else record.input_file_id,
        "input_file_exists": batch.input_exists,
        "output_file_id": None if record is None else record.output_file_id,
        "error_file_id": None if record is None else record.error_file_id,
        "owner": None if batch.held is None else {"held": batch.held},
        "problems": [printable(problem) for problem in batch.problems],
    }


def tables(report: ApiReport, size: Callable[[int], str]) -> list[str]:
    """The batches' and the files' tables, then the answers' cache, for `render` (`size` formats bytes)."""
    lines: list[str] = []
    if report.batches:
        header = ("BATCH", "STATUS", "RECORDED: DONE/FAILED OF TOTAL", "ON DISK: DONE/FAILED", "TORN", "INPUT")
        rows = [(*header, "OUTPUT", "ERRORS", "OWNER"), *(_batch_row(batch) for batch in report.batches)]
        lines += ["", *_table(rows)]
    if report.files:
        files = [(stored.id, stored.filename, stored.purpose, size(stored.bytes)) for stored in report.files]
        lines += ["", *_table([("FILE", "FILENAME", "PURPOSE", "BYTES"), *files])]
    if report.answers is not None and (report.batches or report.answers.entries != 0):  # every proxy makes one
        entries = report.answers.entries
        count = "? entries" if entries is None else f"{entries:,} entr{'y' if entries == 1 else 'ies'}"
        where = f"batches/{ANSWERS}/{HOST_PREFIX}*/00000/replay.sqlite3"
        lines += ["", f"the batches' answers: {count}, {size(report.answers.bytes)} ({where})"]
    return lines


def notes(report: ApiReport) -> list[str]:
    """What a restart does with each batch, one line each."""
    out = []
    for batch in report.batches:
        results = batch.results
        if results is not None and results.torn_at is not None:
            line = "its line" if results.torn_result is None else f"input line {results.torn_result}"
            out.append(
                f"{batch.id}: {RESULTS} ends in a torn line ({results.size - results.torn_at} bytes): a restart "
                f"cuts the file back to {results.torn_at} bytes, dropping it, and runs {line} again"
            )
        if batch.held:
            # owner.lock names no one: a proxy, or `inferproxy run-batch`, whose state folder is a checkpoints dir
            out.append(f"{batch.id} is run by a live process: its files move while they are read")
    return out


def problems(report: ApiReport) -> list[str]:
    """The batches' problems, each naming its batch (the dir's are the dir report's)."""
    return [f"{batch.id}: {problem}" for batch in report.batches for problem in batch.problems]


def _batch_row(batch: BatchReport) -> tuple[str, ...]:
    record, results = batch.record, batch.results
    recorded = "?" if record is None else f"{record.completed}/{record.failed} of {record.total}"
    on_disk = "-" if results is None else f"{results.completed}/{results.failed}"
    torn = "-" if results is None else str(int(results.torn_at is not None))
    owner = "-" if batch.held is None else "held by a live process" if batch.held else "free"
    if record is None:
        return (batch.id, "?", recorded, on_disk, torn, "?", "?", "?", owner)
    return (
        batch.id,
        record.status,
        recorded,
        on_disk,
        torn,
        record.input_file_id + {True: "", False: " (missing)", None: " (?)"}[batch.input_exists],
        record.output_file_id or "-",
        record.error_file_id or "-",
        owner,
    )


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
